"""Errors a user can cause. The CLI prints `str(error)` as one line and exits non-zero."""

import re


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


class KeysFileError(BranchsearchError):
    """The service's API keys file cannot be read: the operator's to fix, not the caller's."""


class OutputTruncated(Exception):
    """A model's output cut at max_tokens before it was complete (`text`: what it wrote). Not a
    user error: a policy turns it into an invalid action."""

    def __init__(self, text: str = ""):
        super().__init__(text)  # (the only argument, so it survives pickling across Ray)

    @property
    def text(self) -> str:
        return self.args[0] if self.args else ""

    def __str__(self) -> str:
        return f"output cut at max_tokens after {len(self.text)} characters"


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def error_line(exc: BaseException, width: int = 300) -> str:
    """`Type: message` on one line, for a status or a log line: an error raised inside a Ray
    task by its cause (not Ray's coloured traceback), escape codes and line breaks dropped."""
    while isinstance(getattr(exc, "cause", None), BaseException) and \
            type(exc).__module__.startswith("ray."):  # a task error inside a task error too
        exc = exc.cause
    text = _ANSI.sub("", f"{type(exc).__name__}: {exc}")
    return " ".join(text.split())[:width]
