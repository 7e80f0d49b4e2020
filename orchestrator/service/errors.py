"""The one error shape of the service: `ApiError` (an HTTP status, a short code, one line of
detail) and `api_error`, which maps any exception to what a caller may see."""

from __future__ import annotations

import logging

from branchsearch.infra.errors import (BackendUnavailable, BadQuery, BranchsearchError,
                                       CorpusError, IndexBusy, IndexIncomplete, IndexNotFound,
                                       IndexNotWritable, KeysFileError, Overloaded,
                                       SettingsError, error_line, public_line)

log = logging.getLogger("branchsearch.service")


class ApiError(Exception):
    """An answer other than 200: `status`, `error` (a code), `detail` (one line), headers, and
    `fields` a client reads as data rather than from the detail's prose (a key's 429: why,
    its counts and limits, `admission.Concurrency`); the server's own figures only, never a
    caller's input."""

    def __init__(self, status: int, error: str, detail: str, headers: dict | None = None,
                 fields: dict | None = None):
        detail = public_line(detail, 1000)  # the one path to a caller: no secret, no address
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail
        self.headers, self.fields = headers or {}, fields or {}

    def body(self) -> dict:
        return {"error": self.error, "detail": self.detail, **self.fields}

    def __reduce__(self):  # crosses Ray Serve handles intact
        return (ApiError, (self.status, self.error, self.detail, self.headers, self.fields))


def shutting_down(detail: str = "the service is stopping; retry on another instance or once "
                  "it is back") -> ApiError:
    """The answer of a service that is stopping (draining, or its indexes closed)."""
    return ApiError(503, "shutting_down", detail, {"Retry-After": "5"})


class Refused:
    """A refusal (an `ApiError`) carried across a Ray Serve handle as a value: raised in the
    Searcher replica, Serve would log every 403, 404 and 429 as a failed request, traceback
    and all, and an operator's log would drown in callers' mistakes."""

    def __init__(self, error: ApiError):
        self.error = error

    def __reduce__(self):
        return (Refused, (self.error,))


# the code `api_error` gives each kind of failure an index's start or probe can meet, for
# /readyz to say why an index is not ready without logging it once more (the order matters:
# the first match wins, as in `api_error`)
_CODES = ((Overloaded, "overloaded"), (BackendUnavailable, "backend_unavailable"),
          (IndexBusy, "index_busy"), (IndexIncomplete, "index_incomplete"),
          (IndexNotWritable, "index_not_writable"), (SettingsError, "index_misconfigured"),
          (IndexNotFound, "index_not_found"), (TimeoutError, "deadline_exceeded"))


def error_code(exc: BaseException) -> str:
    """`api_error(exc).error`, quietly: the short code a caller may see for `exc`."""
    if isinstance(exc, ApiError):
        return exc.error
    return next((code for kind, code in _CODES if isinstance(exc, kind)), "start_failed")


def api_error(exc: BaseException) -> ApiError:
    """Map any exception to what a caller may see; unknown exceptions say only their type."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):  # its limit as fields (the `Overload` schema)
        return ApiError(503, "overloaded", str(exc), {"Retry-After": "1"}, exc.fields)
    if isinstance(exc, BackendUnavailable):  # the whole line (addresses too) in the server log
        log.error("%s", error_line(exc, 1000))
        return ApiError(503, "backend_unavailable", str(exc), {"Retry-After": "5"})
    if isinstance(exc, IndexBusy):  # an ingest holds the index (infra.manifest); which one
        log.warning("index busy: %s", exc)  # (its PID and corpus path) is the server's
        return ApiError(409, "index_busy", "an ingest or another write is updating the index "
                        "right now; retry when it has finished", {"Retry-After": "5"})
    if isinstance(exc, IndexIncomplete):  # an ingest to finish, or store files gone: the server's
        log.warning("index unavailable: %s", exc)  # the operator's fix names server paths
        return ApiError(503, "index_incomplete", "the index is incomplete or damaged on the "
                        "server; its operator must finish or repair it (the server log says how)")
    if isinstance(exc, IndexNotWritable):  # names the server's folder: logged, not sent
        log.error("%s", exc)
        return ApiError(503, "index_not_writable", "the server cannot write this index's files; "
                        "its operator must fix that (the server log says which)")
    if isinstance(exc, KeysFileError):  # names the server's file: logged, not sent
        log.error("%s", exc)
        return ApiError(503, "keys_unavailable", "the server cannot read its API keys file; "
                        "its operator must fix it (the server log says how)")
    if isinstance(exc, SettingsError):  # the server's settings (a caller's index name is
        log.error("%s", error_line(exc, 1000))  # checked before): the operator's to fix
        return ApiError(503, "index_misconfigured", "the server's settings do not let it open "
                        "this index; its operator must fix them (the server log says how)")
    if isinstance(exc, IndexNotFound):
        return ApiError(404, "index_not_found", str(exc))
    if isinstance(exc, (BadQuery, CorpusError)):
        return ApiError(422, "bad_request", str(exc))
    if isinstance(exc, BranchsearchError):
        return ApiError(400, "bad_request", str(exc))
    if isinstance(exc, TimeoutError):
        return ApiError(504, "deadline_exceeded", str(exc) or "the search did not finish in time")
    return ApiError(500, "internal_error", f"{type(exc).__name__} (details in the server log)")
