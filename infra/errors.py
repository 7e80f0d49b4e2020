"""Errors a user can cause. The CLI prints `str(error)` as one line and exits non-zero."""


class BranchsearchError(Exception):
    """Base for user-facing errors: the message names the problem and, where possible, the fix."""


class CorpusError(BranchsearchError):
    """A corpus file or folder that cannot be read (missing, malformed line, empty)."""


class IndexNotFound(BranchsearchError):
    """An index name with nothing ingested under the data home."""


class BackendUnavailable(BranchsearchError):
    """Milvus, Elasticsearch or another server that does not answer."""


class BadQuery(BranchsearchError):
    """A query or regex pattern that is invalid or outside the allowed bounds."""


class SettingsError(BranchsearchError):
    """A settings file, environment variable or flag with a bad value."""


class IndexIncomplete(BranchsearchError):
    """An index whose ingest never finished (no manifest): it must not be read as if complete."""


class IndexBusy(BranchsearchError):
    """An index that a running ingest holds (another ingest, or a reader of an embedded index)."""
