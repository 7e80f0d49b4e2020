"""Token-based chunking into stable ids `"{doc_id}#p{n}"`.

A document is cut into windows of `size` tokens overlapping by `overlap`; window starts snap to
the next token that begins a word so chunks do not start mid-word. The same text, size and
overlap always give the same chunks, so re-ingesting a document replaces its chunks one for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from branchsearch.infra.models.tokenizer import TokenCounter
from branchsearch.infra.stores.hits import label


@dataclass(frozen=True)
class Chunk:
    id: str
    doc_id: str
    n: int
    text: str
    start_token: int
    n_tokens: int  # the window's tokens in the document
    # Counts kept for the agent (None: not counted, the docstore keeps NULL; see `Hit`):
    text_tokens: int | None = None  # `text`'s own tokens (a decoded, stripped window may count
    # otherwise than the window)
    label_tokens: int | None = None  # `label(id, title)`'s tokens
    head: tuple[int, int] | None = None  # (n, chars): `text[:chars]` is its first n tokens


def chunk_id(doc_id: str, n: int) -> str:
    return f"{doc_id}#p{n}"


def split_chunk_id(cid: str) -> tuple[str, int]:
    doc_id, _, n = cid.rpartition("#p")
    if not doc_id or not n.isdigit():
        raise ValueError(f"not a chunk id: {cid!r}")
    return doc_id, int(n)


def head_tokens(settings) -> int:
    """How much of a long chunk an agent shows (`result_token_cap`, less the ellipsis): where
    that ends is kept at ingest, so a search cuts it without encoding."""
    return max(settings.result_token_cap - 1, 0)


def chunk_text(doc_id: str, text: str, counter: TokenCounter, size: int = 256,
               overlap: int = 32, *, title: str = "", head_tokens: int = 0) -> list[Chunk]:
    """The document's chunks, each with its token counts: its text's, its label's (with
    `title`), and, when its text is longer than `head_tokens`, the characters of its first
    `head_tokens` tokens (the agent's cut of a long result; 0: none)."""
    tokens = counter.encode(text)
    if len(tokens) <= size:
        cid = chunk_id(doc_id, 0)
        return [Chunk(cid, doc_id, 0, text, 0, len(tokens),
                      *token_counts(counter, cid, text, title, head_tokens, tokens))]
    raw = text.encode("utf-8")  # the tokens' bytes, one after another
    at = list(accumulate(counter.byte_lengths(tokens), initial=0))  # where each token begins
    chunks: list[Chunk] = []
    start = 0
    while start < len(tokens):
        end = min(start + size, len(tokens))
        piece = _whole_characters(raw, at[start], at[end]).strip()
        cid = chunk_id(doc_id, len(chunks))
        chunks.append(Chunk(cid, doc_id, len(chunks), piece, start, end - start,
                            *token_counts(counter, cid, piece, title, head_tokens)))
        if end == len(tokens):
            break
        start = _word_start(tokens, end - overlap, end, counter)
    return chunks


def token_counts(counter: TokenCounter, cid: str, text: str, title: str, head_tokens: int,
                 tokens: list[int] | None = None) -> tuple[int, int, tuple[int, int] | None]:
    """A chunk's counts for the agent: (text_tokens, label_tokens, head), as `Chunk` keeps
    them; `tokens`: the text's, when already encoded."""
    tokens = counter.encode(text) if tokens is None else tokens
    head = None
    if 0 < head_tokens < len(tokens):
        shown = counter.decode(tokens[:head_tokens])
        if text.startswith(shown):  # not when the cut falls inside a character
            head = (head_tokens, len(shown))
    return len(tokens), counter.count(label(cid, title)), head


def _whole_characters(raw: bytes, lo: int, hi: int) -> str:
    """`raw[lo:hi]` as text, each end moved back to the start of the character it falls in.
    A token may hold part of a character (a Han character, a Thai letter or an emoji is 3-4
    bytes, often split across tokens), so a window of tokens can begin or end inside one:
    decoding its bytes as they are would write U+FFFD into the chunk in place of the
    character. A character cut at a window's end is its next window's first (windows
    overlap or touch)."""
    return raw[_char_start(raw, lo):_char_start(raw, hi)].decode("utf-8")


def _char_start(raw: bytes, i: int) -> int:
    while 0 < i < len(raw) and 0x80 <= raw[i] < 0xC0:  # a UTF-8 continuation byte
        i -= 1
    return i


def _word_start(tokens: list[int], lo: int, hi: int, counter: TokenCounter) -> int:
    """First token in [lo, hi) that starts with whitespace (a word start), else lo."""
    for i in range(lo, hi):
        if counter.decode(tokens[i:i + 1])[:1].isspace():
            return i
    return lo
