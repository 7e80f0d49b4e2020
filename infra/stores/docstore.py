"""The document store: chunk text and per-document metadata in one SQLite file.

It is the source of truth for what is ingested: lexical and dense stores return chunk ids, and
the retriever hydrates them here. An ingest commits in batches; for each batch the docstore is
written first (the batch's documents are removed and marked *pending*) and last (documents and
chunks inserted with their content fingerprint, pending cleared), with the dense and lexical
writes between. So a document present here with a matching fingerprint is complete in every
store, and a document left pending by a killed ingest names exactly the vectors and terms that
may be orphaned (see `infra.ingest.pipeline`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

from branchsearch.infra.ingest.chunking import Chunk
from branchsearch.infra.ingest.corpus import Document

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    doc_id TEXT PRIMARY KEY, title TEXT, source TEXT, date TEXT, acl TEXT, meta TEXT,
    n_chunks INTEGER, fingerprint TEXT, title_key TEXT);
CREATE TABLE IF NOT EXISTS chunks (
    chunk_id TEXT PRIMARY KEY, doc_id TEXT NOT NULL, n INTEGER NOT NULL, text TEXT NOT NULL,
    start_token INTEGER, n_tokens INTEGER, text_tokens INTEGER, label_tokens INTEGER,
    head_tokens INTEGER, head_chars INTEGER);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id, n);
CREATE TABLE IF NOT EXISTS pending (doc_id TEXT PRIMARY KEY);
"""
_TITLE_INDEX = "CREATE INDEX IF NOT EXISTS docs_title_key ON docs(title_key)"
# A chunk's token counts for the agent (`Chunk`, `Hit`), in the index's encoding; NULL in rows
# written before a column was kept, and counted at search time then
_COUNTS = ("text_tokens", "label_tokens", "head_tokens", "head_chars")
NO_COUNTS = {"text_tokens": None, "label_tokens": None, "head": None}  # in a row dict: unknown
KEYS_RETRY_S = 10.0  # a docstore that could not get its title keys on open tries again then


def title_key(title: str) -> str:
    """How `named` compares titles: case folded (any script), accents dropped, spaces
    collapsed ('  École  Normale' and 'ecole normale' are one key; 'Aschenbrödel' is
    'aschenbrodel', as the lexical index folds it)."""
    decomposed = unicodedata.normalize("NFKD", title.casefold())
    return " ".join("".join(c for c in decomposed if not unicodedata.combining(c)).split())


def _locked(method):
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


class DocStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(docs)")}
        if "fingerprint" not in columns:  # a docstore written before fingerprints
            self._db.execute("ALTER TABLE docs ADD COLUMN fingerprint TEXT")
        self._counted = self._count_columns()  # those of `_COUNTS` this file has
        self._lock = threading.RLock()  # one connection, many retriever threads
        self._keys_tried = 0.0
        self._odd: dict[str, list[str]] | None = None  # `_unnormalized`, once asked
        self.has_title_keys = self._title_keys(columns)

    def _title_keys(self, columns: set[str] | None = None) -> bool:
        """Whether every document has its title key, giving them one first where needed: a
        docstore written before `named` (one pass over the titles, about 2 s per million
        documents), or one whose keys a killed open left unfilled. The column, the keys and
        their index commit together or not at all, and only when the write lock is free at
        once: a read-only folder, or another process writing, does not stall the open;
        `named` finds nothing there and tries again later (`KEYS_RETRY_S`)."""
        self._keys_tried = time.monotonic()
        if columns is None:
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(docs)")}
        if "title_key" in columns and self._db.execute(
                "SELECT 1 FROM docs WHERE title_key IS NULL LIMIT 1").fetchone() is None:
            try:
                self._db.execute(_TITLE_INDEX)  # made with the table: a no-op after
            except sqlite3.OperationalError:  # read-only: `named` scans
                pass
            return True
        try:
            self._db.execute("PRAGMA busy_timeout = 0")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if "title_key" not in {r[1] for r in self._db.execute("PRAGMA table_info(docs)")}:
                    self._db.execute("ALTER TABLE docs ADD COLUMN title_key TEXT")
                self._db.executemany("UPDATE docs SET title_key = ? WHERE doc_id = ?", [
                    (title_key(t or ""), d) for d, t in self._db.execute(
                        "SELECT doc_id, title FROM docs WHERE title_key IS NULL").fetchall()])
                self._db.execute(_TITLE_INDEX)
                self._db.commit()
            except BaseException:
                self._db.rollback()
                raise
            return True
        except sqlite3.OperationalError:  # read-only, or locked by another process
            return False
        finally:
            self._db.execute("PRAGMA busy_timeout = 5000")

    @_locked  # never under a reader in another thread: sqlite would crash the process
    def close(self) -> None:
        self._db.close()

    @_locked
    def begin_batch(self, doc_ids: Sequence[str]) -> None:
        """Remove `doc_ids` and mark them pending, before their other stores are rewritten."""
        with self._db:
            ids = [(d,) for d in doc_ids]
            self._db.executemany("DELETE FROM chunks WHERE doc_id = ?", ids)
            self._db.executemany("DELETE FROM docs WHERE doc_id = ?", ids)
            self._db.executemany("INSERT OR IGNORE INTO pending VALUES (?)", ids)

    @_locked
    def replace_documents(self, docs: Sequence[Document], chunks: Iterable[Chunk],
                          fingerprints: dict[str, str] | None = None,
                          replaced: Sequence[str] = ()) -> None:
        """Replace `docs` and all their chunks in one transaction, removing the documents
        `replaced` names with them (their ids in another Unicode form: `other_forms`); they
        stop being pending."""
        fingerprints = fingerprints or {}
        with self._db:
            if len(self._counted) < len(_COUNTS):  # written before: its old rows stay NULL
                self._add_count_columns()
            ids = [(i,) for i in dict.fromkeys([*(d.id for d in docs), *replaced])]
            self._db.executemany("DELETE FROM chunks WHERE doc_id = ?", ids)
            self._db.executemany("DELETE FROM docs WHERE doc_id = ?", ids)
            by_doc: dict[str, int] = {}
            rows = []
            for c in chunks:
                by_doc[c.doc_id] = by_doc.get(c.doc_id, 0) + 1
                head = c.head or (None, None)
                rows.append((c.id, c.doc_id, c.n, c.text, c.start_token, c.n_tokens,
                             c.text_tokens, c.label_tokens, head[0], head[1]))
            self._db.executemany("INSERT INTO chunks (chunk_id, doc_id, n, text, start_token, "
                                 f"n_tokens, {', '.join(_COUNTS)}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                                 rows)
            self._db.executemany(
                "INSERT INTO docs (doc_id, title, source, date, acl, meta, n_chunks, "
                "fingerprint, title_key) VALUES (?,?,?,?,?,?,?,?,?)",
                [(d.id, d.title, d.source, d.date, json.dumps(list(d.acl)), json.dumps(d.meta),
                  by_doc.get(d.id, 0), fingerprints.get(d.id), title_key(d.title or ""))
                 for d in docs])
            self._db.executemany("DELETE FROM pending WHERE doc_id = ?", ids)
        if self._odd is not None:  # (ingest writes NFC: only a hand-made Document is not)
            for d in docs:
                key = unicodedata.normalize("NFC", d.id)
                if key != d.id and d.id not in self._odd.setdefault(key, []):
                    self._odd[key].append(d.id)

    @_locked
    def delete_documents(self, doc_ids: Sequence[str]) -> None:
        """Remove documents and their chunks in one transaction (unknown ids are ignored)."""
        with self._db:
            ids = [(d,) for d in doc_ids]
            self._db.executemany("DELETE FROM chunks WHERE doc_id = ?", ids)
            self._db.executemany("DELETE FROM docs WHERE doc_id = ?", ids)

    @_locked
    def pending(self) -> list[str]:
        """Documents a stopped ingest removed here but never committed back."""
        return [r[0] for r in self._db.execute("SELECT doc_id FROM pending ORDER BY doc_id")]

    @_locked
    def clear_pending(self, doc_ids: Sequence[str]) -> None:
        with self._db:
            self._db.executemany("DELETE FROM pending WHERE doc_id = ?", [(d,) for d in doc_ids])

    @_locked
    def fingerprints(self, doc_ids: Sequence[str]) -> dict[str, str]:
        """doc id -> content fingerprint, for the committed documents among `doc_ids`."""
        out: dict[str, str] = {}
        for batch in _batches(doc_ids, 500):
            marks = ",".join("?" * len(batch))
            out.update((r[0], r[1]) for r in self._db.execute(
                f"SELECT doc_id, fingerprint FROM docs WHERE doc_id IN ({marks}) "
                f"AND fingerprint IS NOT NULL", batch))
        return out

    @_locked
    def with_u_fffd(self) -> set[str]:
        """The documents a chunk of which holds U+FFFD, the replacement character: an index
        chunked without `chunking._whole_characters` holds it where a window cut a character,
        and the next ingest redoes those documents (one scan of the chunks' text)."""
        return {r[0] for r in self._db.execute(
            "SELECT DISTINCT doc_id FROM chunks WHERE instr(text, char(65533)) > 0")}

    @_locked
    def chunk_counts(self, doc_ids: Sequence[str]) -> int:
        """Chunks of the committed documents among `doc_ids`."""
        total = 0
        for batch in _batches(doc_ids, 500):
            marks = ",".join("?" * len(batch))
            total += self._db.execute(
                f"SELECT COALESCE(SUM(n_chunks), 0) FROM docs WHERE doc_id IN ({marks})",
                batch).fetchone()[0]
        return total

    @_locked
    def chunk_count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    @_locked
    def doc_count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM docs").fetchone()[0]

    @_locked
    def present(self, doc_ids: Sequence[str]) -> set[str]:
        """The documents among `doc_ids` that searches can find (ingested or uploaded)."""
        out: set[str] = set()
        for batch in _batches(doc_ids, 500):
            marks = ",".join("?" * len(batch))
            out.update(r[0] for r in self._db.execute(
                f"SELECT doc_id FROM docs WHERE doc_id IN ({marks})", batch))
        return out

    @_locked
    def stored_ids(self, doc_id: str) -> list[str]:
        """The ids this docstore holds the document `doc_id` under, those present: `doc_id` as
        given, its NFC form (how ingest writes ids), its NFD form, and any other spelling with
        that NFC form an earlier version stored as typed (`_unnormalized`: mixed forms,
        compatibility characters); [] when it has none, one as a rule (a write replaces every
        other form), more where an earlier version wrote several."""
        key = unicodedata.normalize("NFC", doc_id)
        forms = list(dict.fromkeys([doc_id, key, unicodedata.normalize("NFD", doc_id),
                                    *self._unnormalized().get(key, ())]))
        found = self.present(forms)
        return [i for i in forms if i in found]

    @_locked
    def other_forms(self, doc_ids: Sequence[str]) -> list[str]:
        """The documents held under another spelling of one of `doc_ids` with the same NFC form
        (an id an earlier version stored as typed: NFD, mixed, a compatibility character):
        the ones a write of `doc_ids` replaces."""
        given = set(doc_ids)
        odd = self._unnormalized()
        forms: set[str] = set()
        for d in given:
            if not d.isascii():
                key = unicodedata.normalize("NFC", d)
                forms.update((d, key, unicodedata.normalize("NFD", d), *odd.get(key, ())))
        forms -= given
        return sorted(self.present(sorted(forms)))

    def _unnormalized(self) -> dict[str, list[str]]:
        """NFC form -> the stored ids not in NFC that have it (written by an earlier version,
        which kept ids as typed), read in one pass over the ids the first time it is asked.
        Ingest writes NFC only, so the map can only name ids since replaced; callers keep the
        present ones. (Another process of an earlier version writing meanwhile is not seen
        until the next open, but for NFD ids, which the callers also try.)"""
        if self._odd is None:
            odd: dict[str, list[str]] = {}
            for (doc_id,) in self._db.execute("SELECT doc_id FROM docs"):
                if not doc_id.isascii():
                    key = unicodedata.normalize("NFC", doc_id)
                    if key != doc_id:
                        odd.setdefault(key, []).append(doc_id)
            self._odd = odd
        return self._odd

    @_locked
    def existing_chunk_ids(self, doc_ids: Sequence[str]) -> list[str]:
        out: list[str] = []
        for batch in _batches(doc_ids, 500):
            marks = ",".join("?" * len(batch))
            out += [r[0] for r in self._db.execute(
                f"SELECT chunk_id FROM chunks WHERE doc_id IN ({marks})", batch)]
        return out

    @_locked
    def get_chunks(self, chunk_ids: Sequence[str]) -> dict[str, dict]:
        """chunk id -> {chunk_id, doc_id, n, text, title, acl, ...}; unknown ids are absent."""
        found: dict[str, dict] = {}
        for batch in _batches(list(dict.fromkeys(chunk_ids)), 500):
            marks = ",".join("?" * len(batch))
            for row in self._db.execute(
                f"SELECT c.chunk_id, c.doc_id, c.n, c.text, c.n_tokens, d.title, d.source, "
                f"d.date, d.acl, {self._count_columns_sql('c.')} FROM chunks c "
                f"JOIN docs d USING (doc_id) WHERE c.chunk_id IN ({marks})", batch):
                found[row[0]] = {"chunk_id": row[0], "doc_id": row[1], "n": row[2],
                                 "text": row[3], "n_tokens": row[4], "title": row[5],
                                 "source": row[6], "date": row[7], "acl": json.loads(row[8]),
                                 **_counts(row[9:])}
        return found

    @_locked
    def get_document(self, doc_id: str) -> dict | None:
        """The document `doc_id` names, in whichever Unicode form this docstore holds its id
        (`stored_ids`; its `doc_id` says which), with its chunk ids; None when it has none."""
        doc_id = next(iter(self.stored_ids(doc_id)), doc_id)
        row = self._db.execute(
            "SELECT doc_id, title, source, date, acl, meta, n_chunks FROM docs WHERE doc_id = ?",
            (doc_id,)).fetchone()
        if row is None:
            return None
        chunks = [r[0] for r in self._db.execute(
            "SELECT chunk_id FROM chunks WHERE doc_id = ? ORDER BY n", (doc_id,))]
        return {"doc_id": row[0], "title": row[1], "source": row[2], "date": row[3],
                "acl": json.loads(row[4]), "meta": json.loads(row[5]), "n_chunks": row[6],
                "chunk_ids": chunks}

    @_locked
    def document_chunks(self, doc_id: str) -> list[dict]:
        """The chunks of the document `doc_id` names (as `get_document` finds it), in order."""
        doc_id = next(iter(self.stored_ids(doc_id)), doc_id)
        return [{"chunk_id": r[0], "n": r[1], "text": r[2], "n_tokens": r[3], **_counts(r[4:])}
                for r in self._db.execute(
                    f"SELECT chunk_id, n, text, n_tokens, {self._count_columns_sql()} "
                    "FROM chunks WHERE doc_id = ? ORDER BY n", (doc_id,))]

    @_locked
    def read_document(self, doc_id: str) -> tuple[dict, list[dict]] | None:
        """`get_document` and `document_chunks` in one read transaction: the document and its
        chunks as one write left them, never its groups from before a write and its text from
        after (another connection's write — the service's, an ingest's — waits for it, or is
        not seen by it). None when there is no such document."""
        began = not self._db.in_transaction  # (within one, it is that one's snapshot)
        if began:
            self._db.execute("BEGIN")
        try:
            doc = self.get_document(doc_id)
            return None if doc is None else (doc, self.document_chunks(doc["doc_id"]))
        finally:
            if began:
                self._db.execute("COMMIT")  # (nothing written: it only ends the snapshot)

    @_locked
    def uncounted(self, limit: int, head_tokens: int) -> list[tuple[str, str, str]]:
        """(chunk id, text, title) of up to `limit` chunks written before their token counts
        were kept, or with a head of other than `head_tokens` tokens."""
        if len(self._counted) < len(_COUNTS):
            if not self._db.execute("SELECT 1 FROM chunks LIMIT 1").fetchone():
                return []
            with self._db:
                self._add_count_columns()
        return self._db.execute(
            "SELECT c.chunk_id, c.text, COALESCE(d.title, '') FROM chunks c JOIN docs d "
            "USING (doc_id) WHERE c.label_tokens IS NULL OR c.head_tokens != ? LIMIT ?",
            (head_tokens, limit)).fetchall()

    @_locked
    def set_counts(self, counts: dict[str, tuple]) -> None:
        """chunk id -> (text_tokens, label_tokens, head), in one transaction."""
        with self._db:
            self._db.executemany(
                "UPDATE chunks SET text_tokens = ?, label_tokens = ?, head_tokens = ?, "
                "head_chars = ? WHERE chunk_id = ?",
                [(t, lt, *(head or (None, None)), cid)
                 for cid, (t, lt, head) in counts.items()])

    def _count_columns(self) -> set[str]:
        return set(_COUNTS) & {r[1] for r in self._db.execute("PRAGMA table_info(chunks)")}

    def _add_count_columns(self) -> None:
        """Give `chunks` the count columns it lacks (another connection may have added some)."""
        for column in [c for c in _COUNTS if c not in self._count_columns()]:
            self._db.execute(f"ALTER TABLE chunks ADD COLUMN {column} INTEGER")
        self._counted = set(_COUNTS)

    def _count_columns_sql(self, table: str = "") -> str:
        return ", ".join(f"{table}{c}" if c in self._counted else "NULL" for c in _COUNTS)

    @_locked
    def named(self, name: str, limit: int = 20, exclude: Sequence[str] = (),
              groups: Sequence[str] | None = None) -> list[dict]:
        """Documents titled `name` or `name (qualifier)` ('Brand' names 'Brand (play)'),
        compared by `title_key`: {doc_id, title, acl, chunk_id of its first chunk, exact: the
        title without a qualifier}, exact titles first, at most `limit` of those whose first chunk is not in `exclude` and that
        `groups` may see (`infra.stores.protocols.acl_terms`' terms; None: every document). By the
        title key index (two range lookups, no pattern); [] while the docstore has no title
        keys (`_title_keys`)."""
        key = title_key(name)
        if not key:
            return []
        if not self.has_title_keys and time.monotonic() - self._keys_tried > KEYS_RETRY_S:
            self.has_title_keys = self._title_keys()
        if not self.has_title_keys:
            return []
        exclude = list(dict.fromkeys(exclude))
        sql = ("SELECT d.doc_id, d.title, d.acl, c.chunk_id, d.title_key = ? "
               "FROM docs d JOIN chunks c "
               "ON c.doc_id = d.doc_id AND c.n = 0 "
               "WHERE (d.title_key = ? OR (d.title_key >= ? AND d.title_key < ?))")
        args: list = [key, key, key + " (", key + " )"]
        if exclude:
            sql += f" AND c.chunk_id NOT IN ({','.join('?' * len(exclude))})"
            args += exclude
        if groups is not None:  # public, or restricted to one of the groups
            sql += (" AND (json_array_length(d.acl) = 0 OR EXISTS (SELECT 1 FROM "
                    f"json_each(d.acl) WHERE value IN ({','.join('?' * len(groups))})))")
            args += list(groups)
        sql += " ORDER BY d.title_key != ?, length(d.title_key), d.doc_id LIMIT ?"
        rows = self._db.execute(sql, [*args, key, limit]).fetchall()
        return [{"doc_id": r[0], "title": r[1], "acl": json.loads(r[2]), "chunk_id": r[3],
                 "exact": bool(r[4])} for r in rows]

    @_locked
    def titles(self) -> dict[str, str]:
        """doc id -> title, for every document (used for entity links between documents)."""
        return dict(self._db.execute("SELECT doc_id, title FROM docs"))


def _counts(row: Sequence) -> dict:
    """A chunk's `_COUNTS` columns as its row dict holds them (`Hit`'s fields)."""
    text_tokens, label_tokens, head_tokens, head_chars = row
    return {"text_tokens": text_tokens, "label_tokens": label_tokens,
            "head": None if head_tokens is None or head_chars is None
            else (head_tokens, head_chars)}


def _batches(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield list(items[i:i + size])
