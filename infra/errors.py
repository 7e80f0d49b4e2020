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


class ClusterLost(BackendUnavailable):
    """The Ray cluster this process joined is gone (its head node's GCS takes no connection):
    no question can run on it any more, and none is to blame."""


class Overloaded(BranchsearchError):
    """No capacity for the work within its deadline (every branch actor busy): retry later.
    `fields`: the limit met as data (`reason`, `in_use`, `limits`), as the service's 503
    `overloaded` body gives them."""

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.fields = fields

    def __reduce__(self):  # crosses Ray intact, fields and all
        return (Overloaded, (str(self), self.fields))


def overload(reason: str, in_use: int | None, **limits: int) -> dict:
    """The fields of a refusal for want of capacity: which limit was met (`reason`), how many
    of what it counts were in use (None: not known here), and the limit(s) by setting name."""
    return {"reason": reason, "in_use": in_use, "limits": limits}


class BadQuery(BranchsearchError):
    """A query or regex pattern that is invalid or outside the allowed bounds."""


class SettingsError(BranchsearchError):
    """A settings file, environment variable or flag with a bad value."""


class IndexNameTaken(SettingsError):
    """An owned index whose backend name (its Milvus collection) already holds another index:
    two names the backend cannot tell apart ('a-b' and 'a_b'). Refused before anything is
    written."""


class IndexIncomplete(BranchsearchError):
    """An index whose ingest never finished (no manifest): it must not be read as if complete."""


class IndexBusy(BranchsearchError):
    """An index that a running ingest holds (another ingest, or a reader of an embedded index)."""


class IndexNotWritable(BranchsearchError):
    """An index folder this process may not write (permissions, a read-only filesystem), asked
    to take an ingest or a write."""


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
    return " ".join(redact(text).split())[:width]


# --- what may leave the process ------------------------------------------------------------------
# Every message that can reach someone outside (a CLI line, a report, a span, an HTTP body) goes
# through `redact`: no credentials. What reaches a *caller* of the service goes through
# `public_line` as well: no internal address either (those stay in the server log).

_SECRETS: set[str] = set()  # secret values from the settings that `redact` masks as tokens
_SECRET_TOKENS: re.Pattern[str] | None = None  # any of them, longest first
# userinfo ends at the *last* '@' before the host, as URL parsers read it: a password with a
# raw '@' ("user:Es@Pass@host") is masked whole
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
# a credential's value: after "name:" / "name=" for every credential word, after a space only
# for the auth schemes ("Bearer X"): "GET /passwd (see /docs)" names a path, not a password
_CREDENTIAL = re.compile(
    r"(?i)(?P<name>(?:\b(?:authorization|bearer|basic|api[_-]?key|apikey|token|password|passwd|"
    r"secret)\b[\"']?\s*[:=]\s*|\b(?:authorization|bearer|basic|apikey)\s+)"
    r"(?!(?:(?:bearer|basic|apikey)\s+)?[\"']?KEY\b)"  # the placeholder of "Bearer KEY"
    r"(?:(?:bearer|basic|apikey)\s+)?[\"']?)[^\s\"',;)}\]]+")
_PORT = re.compile(r"(\b(?:host|port)=)'?[^\s,)']+'?")
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>),;]+")
_SOCKET = re.compile(r"\bunix:[^\s\"'<>),;:]+")  # a Unix socket address (gRPC's unix:PATH)
# gRPC's peer addresses: "ipv4:10.0.0.5:19530", "ipv6:[::1]:19530", "dns:///host:443"
_GRPC_PEER = re.compile(r"(?i)\b(?:ipv4|ipv6|dns|unix-abstract|vsock):[^\s\"'<>),;]+")
_INTERNAL_ID = re.compile(r"(?i)\b(collection(?:[_ ]?id)?\s*[=:]\s*)\d{6,}")  # Milvus's ids
# an absolute file path of two or more parts (a data home, a store file), not an API route
_PATH = re.compile(r"(?<![\w.:/~-])(?!/v1/)(?:/[^\s/\"'<>(),;:]+){2,}/?")
# a process's or Ray's identifiers (a Ray error names the dead actor's pid, id, namespace)
_PROCESS = re.compile(r"(?i)\b(pid|actor[_ ]id|namespace|node[_ ]id|job[_ ]id|worker[_ ]id|"
                      r"task[_ ]id)(\s*[:=]\s*|\s+(?=\d))(['\"]?)[\w-]+\3")
_RAY_ID = re.compile(r"\b(ActorID\(|actor )[0-9a-f]{16,}")  # Ray's "The actor <hex> is ..."
_MEMORY = re.compile(r" at 0x[0-9a-fA-F]+\b")  # a repr's "<RetrieverService object at 0x7f…>"
_ADDRESS = re.compile(
    r"(?<![\w.-])(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:]+\]|localhost|"
    r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::\d{1,5})?(?![\w-])|"
    r"(?<![\w.-])[A-Za-z0-9-]+:\d{2,5}\b(?![.\d])")  # (not "addr:10" of "addr:10.0.0.5")


def register_secret(value: str | None) -> None:
    """Mask `value` (an API key, a token, a password) in every message `redact` sees, where its
    text stands alone (see `_stands_alone`); a URL's userinfo is masked whatever it holds."""
    global _SECRET_TOKENS
    if value and _stands_alone(value) and value not in _SECRETS:
        _SECRETS.add(value)
        _SECRET_TOKENS = re.compile("|".join(
            _as_token(secret) for secret in sorted(_SECRETS, key=len, reverse=True)))


def _stands_alone(secret: str) -> bool:
    """Whether a secret's text can be masked on its own without eating the words of a message.

    A password such as "index", "search" or "elastic" is a word every error line uses, and one
    of a letter or two is inside most words: masked everywhere, such a text would leave a line
    unreadable ("*** 'corp': Elastic*** *** ..."). So the text alone is masked only when it
    cannot be an ordinary word or number of a message: at least 4 characters that mix letters
    with digits or symbols ("hunter2", "Zq7@Word-x1", "Mv-Secret-77", "Пароль-2024"), or that
    turn from lower to upper case inside ("ElasticPass"), or 20 characters or more (a
    passphrase, a generated token). A plain word or number ("elastic", "pässwörd", "12345") is
    masked where it is a credential: in a URL's userinfo and after password=/token:/Bearer, as
    every secret is."""
    if len(secret) < 4:
        return False
    if len(secret) >= 20:
        return True
    turns_case = any(a.islower() and b.isupper() for a, b in zip(secret, secret[1:]))
    return not secret.isdigit() and (turns_case or not secret.isalpha())


def _as_token(secret: str) -> str:
    """`secret` as a whole token: not a part of a longer word ("hunter2" is masked in
    "hunter2's", not in "hunter22"); a secret that begins or ends with a symbol is matched
    there as it is."""
    head = r"(?<!\w)" if re.match(r"\w", secret) else ""
    tail = r"(?!\w)" if re.search(r"\w\Z", secret) else ""
    return f"{head}{re.escape(secret)}{tail}"


def redact(text: str) -> str:
    """`text` without credentials: the userinfo of every URL (`scheme://***@host`), the values
    after authorization/api key/token/password words, and every registered secret where its
    text stands as a token of its own (`_stands_alone` says which secrets)."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    text = _CREDENTIAL.sub(r"\g<name>***", text)
    return _SECRET_TOKENS.sub("***", text) if _SECRET_TOKENS else text


def public_line(exc_or_text: BaseException | str, width: int = 300) -> str:
    """One line for a caller of the service: `redact`ed, URLs, Unix sockets and host[:port]
    addresses replaced by `<server>`, absolute file paths by `<path>`, process and Ray ids
    (pid, actor_id, namespace, ...) by `<hidden>`; a repr's memory address is left out. Our own
    errors (`BranchsearchError`) give their message alone, written for a user; another
    exception is named by its type."""
    if isinstance(exc_or_text, BranchsearchError):
        exc_or_text = str(exc_or_text)
    text = error_line(exc_or_text, 10_000) if isinstance(exc_or_text, BaseException) \
        else " ".join(redact(exc_or_text).split())
    text = _URL.sub("<server>", text)
    text = _SOCKET.sub("<server>", text)
    text = _GRPC_PEER.sub("<server>", text)
    text = _INTERNAL_ID.sub(r"\g<1><hidden>", text)
    text = _PATH.sub("<path>", text)
    text = _PROCESS.sub(r"\g<1>\g<2><hidden>", text)
    text = _RAY_ID.sub(r"\g<1><hidden>", text)
    text = _MEMORY.sub("", text)
    text = _PORT.sub(r"\g<1><server>", text)
    text = _ADDRESS.sub(lambda m: m.group(0) if _not_address(m.group(0)) else "<server>", text)
    return text[:width]


def _not_address(token: str) -> bool:
    """Dotted words that are not hosts: file names, versions, dotted Python names, numbers."""
    if ":" in token or token.startswith("[") or token == "localhost":
        return False
    if re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", token):
        return False
    last = token.rsplit(".", 1)[-1].lower()
    return last not in _TLDS


_TLDS = {"com", "net", "org", "io", "local", "internal", "lan", "corp", "cloud", "dev", "svc",
         "cluster", "intra", "home", "example", "test", "ai", "co", "de", "uk", "fr", "eu", "us"}
