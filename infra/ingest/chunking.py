"""Token-based chunking into stable ids `"{doc_id}#p{n}"`.

A document is cut into windows of `size` tokens overlapping by `overlap`; window starts snap to
the next token that begins a word so chunks do not start mid-word. The same text, size and
overlap always give the same chunks, so re-ingesting a document replaces its chunks one for one.
"""

from __future__ import annotations

from dataclasses import dataclass

from branchsearch.infra.models.tokenizer import TokenCounter


@dataclass(frozen=True)
class Chunk:
    id: str
    doc_id: str
    n: int
    text: str
    start_token: int
    n_tokens: int  # the window's tokens in the document
    text_tokens: int | None = None  # `text`'s own tokens (a decoded, stripped window may count
    # otherwise than the window); None: not counted, the docstore keeps NULL


def chunk_id(doc_id: str, n: int) -> str:
    return f"{doc_id}#p{n}"


def split_chunk_id(cid: str) -> tuple[str, int]:
    doc_id, _, n = cid.rpartition("#p")
    if not doc_id or not n.isdigit():
        raise ValueError(f"not a chunk id: {cid!r}")
    return doc_id, int(n)


def chunk_text(doc_id: str, text: str, counter: TokenCounter, size: int = 256,
               overlap: int = 32) -> list[Chunk]:
    tokens = counter.encode(text)
    if len(tokens) <= size:
        return [Chunk(chunk_id(doc_id, 0), doc_id, 0, text, 0, len(tokens), len(tokens))]
    chunks: list[Chunk] = []
    start = 0
    while start < len(tokens):
        end = min(start + size, len(tokens))
        piece = counter.decode(tokens[start:end]).strip()
        chunks.append(Chunk(chunk_id(doc_id, len(chunks)), doc_id, len(chunks), piece, start,
                            end - start, counter.count(piece)))
        if end == len(tokens):
            break
        start = _word_start(tokens, end - overlap, end, counter)
    return chunks


def _word_start(tokens: list[int], lo: int, hi: int, counter: TokenCounter) -> int:
    """First token in [lo, hi) that starts with whitespace (a word start), else lo."""
    for i in range(lo, hi):
        if counter.decode(tokens[i:i + 1])[:1].isspace():
            return i
    return lo
