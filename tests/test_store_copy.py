"""How the tests copy an index folder or a data home (`store_copy.copy_store`): never in the
pytest process, which holds the session home's SQLite files open, and SQLite files through the
backup API."""

from __future__ import annotations

import ast
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from store_copy import SQLITE_MAGIC, copy_store

TESTS = Path(__file__).parent
# a child that takes the database's write lock at once or says it is locked
WRITER = ("import sqlite3, sys\nc = sqlite3.connect(sys.argv[1], timeout=0)\n"
          "try:\n    c.execute('BEGIN EXCLUSIVE')\n    print('took the lock')\n"
          "except sqlite3.OperationalError as exc:\n    print(exc)\n")


def _writer_says(db: Path) -> str:
    return subprocess.run([sys.executable, "-c", WRITER, str(db)], capture_output=True,
                          text=True, timeout=60).stdout.strip()


def test_a_copy_keeps_this_processs_sqlite_lock_and_what_the_wal_holds(tmp_path):
    """A folder holding a database this process reads in a transaction (its shared lock held)
    and one in WAL mode whose rows are still in its WAL: after the copy, another process still
    cannot take the first's write lock (a copy made here with `shutil.copytree` opens and closes
    the file, which drops this process's lock, and the other process takes it), and the copy of
    the second holds its rows, with no `-wal` or `-shm` file beside it."""
    src = tmp_path / "index"
    (src / "tantivy").mkdir(parents=True)
    (src / "tantivy" / "meta.json").write_text("{}")
    (src / "manifest.json").write_text('{"index": "x"}')
    held, walled = src / "docs.sqlite", src / "cache.sqlite"
    with closing(sqlite3.connect(held, isolation_level=None)) as reader, \
            closing(sqlite3.connect(walled, isolation_level=None)) as writer:
        reader.execute("CREATE TABLE t (x)")
        reader.execute("INSERT INTO t VALUES (1)")
        reader.execute("BEGIN")
        assert reader.execute("SELECT x FROM t").fetchall() == [(1,)]  # a shared lock
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        assert writer.execute("PRAGMA journal_mode = WAL").fetchone() == ("wal",)
        writer.execute("CREATE TABLE v (y)")
        writer.executemany("INSERT INTO v VALUES (?)", [(i,) for i in range(100)])
        assert (src / "cache.sqlite-wal").stat().st_size > 0
        assert _writer_says(held) == "database is locked"

        copy_store(src, tmp_path / "copy", ignore=("manifest.json",))

        assert _writer_says(held) == "database is locked"  # this process's lock is kept
        assert reader.execute("SELECT x FROM t").fetchall() == [(1,)]
        reader.execute("COMMIT")
    copy = tmp_path / "copy"
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*")) == [
        "cache.sqlite", "docs.sqlite", "tantivy", "tantivy/meta.json"]
    with closing(sqlite3.connect(copy / "cache.sqlite")) as c:
        assert c.execute("SELECT count(*) FROM v").fetchone() == (100,)
    assert (copy / "docs.sqlite").read_bytes()[:16] == SQLITE_MAGIC
    copy_store(src / "manifest.json", tmp_path / "one" / "manifest.json")  # a file alone
    assert (tmp_path / "one" / "manifest.json").read_text() == '{"index": "x"}'


def test_no_test_copies_an_index_or_a_home_with_shutil():
    """A test that copies a settings' folder (an index, a home, a cache) does it through
    `copy_store`; `shutil` copies only the repository's own fixtures."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "shutil" \
                    and node.func.attr in ("copy", "copy2", "copyfile", "copytree") \
                    and node.args and any(word in ast.unparse(node.args[0]) for word in
                                          ("index_dir", "home", "settings", "cache")):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert found == [], found
