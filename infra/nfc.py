"""The one Unicode form of text in branchsearch: NFC.

`ü` can be written composed (U+00FC, NFC: what most keyboards and files give) or decomposed
(`u` + U+0308, NFD: what macOS gives for file names and often for typed text). The two look
alike but are different strings: a tokenizer splits `Zu\u0308rich` at the combining mark
(`zu`, `rich`) and a name extractor stops at it. So text is brought to NFC where it enters:
a document's id, title and text at ingest (`infra.ingest.corpus`), and every question, query
and grep pattern a search is given (`workers.query.check_question`, `workers.tools.fit_query`,
`Retriever.search`/`grep`, the service's request). Stores, indexes and queries then hold one
form. An index ingested by an earlier version may hold NFD text; ingesting it again rewrites
it (the documents' fingerprints change with their text)."""

from __future__ import annotations

import unicodedata


def nfc(text: str) -> str:
    """`text` in Unicode NFC (the same object when it already is, as nearly all text is)."""
    return text if text.isascii() or unicodedata.is_normalized("NFC", text) else \
        unicodedata.normalize("NFC", text)
