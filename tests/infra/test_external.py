"""External indexes: an Elasticsearch index and a Milvus collection under foreign field names,
created here with the official clients (the noida-db emulator or BRANCHSEARCH_ES_URL; Milvus
Lite), searched through the `[indexes.NAME]` mapping without re-ingesting anything."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from branchsearch.infra.errors import BackendUnavailable, BadQuery, SettingsError
from branchsearch.infra.index.open import open_retriever
from branchsearch.infra.config.settings import load_settings

from conftest import HOTPOT
from store_copy import copy_store

RESTRICTED = {"scott-derrickson": ["film-dept"]}  # one document only a group may see


# callers of an index with an acl field: (name, the groups its key holds)
CALLERS = (("nobody", None), ("finance", ["finance"]), ("hr", ["hr"]), ("admin", ["*"]))


def _assert_read(r, key: str, groups, sees: bool, why=None) -> None:
    """A read by id of `key` by a caller holding `groups`: its chunks when the caller `sees`
    the document, else `unknown document`, as for an id that does not exist."""
    if sees:
        assert r.read_document(key, acl_groups=groups)["chunks"], why
    else:
        with pytest.raises(BadQuery, match="unknown document"):
            r.read_document(key, acl_groups=groups)


def _assert_shapes_seen(r, shapes: dict, query: str, mode: str, k: int) -> None:
    """Each caller of `CALLERS` finds by search, and reads by id, exactly the documents of
    `shapes` ({doc id: (acl, callers who see it)}) it may see: an admin all, "anyone" public."""
    for caller, groups in CALLERS:
        found = {h.doc_id for h in r.search(query, mode=mode, k=k, acl_groups=groups)}
        for key, (_, who) in shapes.items():
            sees = caller == "admin" or "anyone" in who or caller in who
            assert (key in found) == sees, (caller, key, "search")
            _assert_read(r, key, groups, sees, (caller, key))


def _docs() -> list[dict]:
    return [json.loads(line) for line in (HOTPOT / "corpus.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def foreign(es_url, tmp_path_factory):
    """A foreign-schema ES index and Milvus Lite collection holding hotpot-mini; the TOML that
    maps them; the home to run in."""
    from elasticsearch import Elasticsearch
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder

    home = tmp_path_factory.mktemp("ext-home")
    docs = _docs()
    es_index = f"corp-docs-{uuid.uuid4().hex[:8]}"
    es = Elasticsearch(es_url)
    es.indices.create(index=es_index, mappings={"properties": {
        "doc_key": {"type": "keyword"}, "headline": {"type": "text"},
        "body": {"type": "text"}, "groups": {"type": "keyword"}}})
    for d in docs:
        source = {"doc_key": d["_id"], "headline": d["title"], "body": d["text"]}
        if d["_id"] in RESTRICTED:
            source["groups"] = RESTRICTED[d["_id"]]
        es.index(index=es_index, id=f"es-{d['_id']}", document=source)
    es.indices.refresh(index=es_index)

    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu")
    vectors = embedder.embed([f"{d['title']}\n{d['text']}" for d in docs])
    uri = str(home / "corp.db")
    client = MilvusClient(uri=uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("headline", DataType.VARCHAR, max_length=1024)
    schema.add_field("body", DataType.VARCHAR, max_length=8192)
    schema.add_field("groups", DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=8,
                     max_length=64)
    schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=embedder.dim)
    index = client.prepare_index_params()
    index.add_index(field_name="embedding", index_type="FLAT", metric_type="IP")
    client.create_collection("corp_vectors", schema=schema, index_params=index)
    client.insert("corp_vectors", [
        {"doc_key": d["_id"], "headline": d["title"], "body": d["text"],
         "groups": RESTRICTED.get(d["_id"], []), "embedding": v.tolist()}
        for d, v in zip(docs, vectors)])
    small = client.create_schema(auto_id=False, enable_dynamic_field=False)
    small.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=256)
    small.add_field("body", DataType.VARCHAR, max_length=8192)
    small.add_field("embedding", DataType.FLOAT_VECTOR, dim=8)
    index8 = client.prepare_index_params()
    index8.add_index(field_name="embedding", index_type="FLAT", metric_type="IP")
    client.create_collection("tiny_vectors", schema=small, index_params=index8)
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)  # one process per Lite file: let go of it

    fields = ('[indexes.{name}.fields]\nid = "doc_key"\ntitle = "headline"\ntext = "body"\n'
              'acl = "groups"\nvector = "embedding"\n')
    toml = home / "branchsearch.toml"
    toml.write_text(
        f'es_url = "{es_url}"\nmilvus_uri = "{uri}"\n'
        f'[indexes.corp]\nlexical = "elasticsearch"\nes_index = "{es_index}"\n'
        f'dense = "milvus"\nmilvus_collection = "corp_vectors"\n' + fields.format(name="corp")
        + f'[indexes.corp_es]\nlexical = "elasticsearch"\nes_index = "{es_index}"\n'
        + fields.format(name="corp_es")
        + '[indexes.corp_vec]\ndense = "milvus"\nmilvus_collection = "corp_vectors"\n'
        + fields.format(name="corp_vec")
        + '[indexes.tiny]\ndense = "milvus"\nmilvus_collection = "tiny_vectors"\n'
        + fields.format(name="tiny")
        + '[indexes.broken]\ndense = "milvus"\nmilvus_collection = "corp_vectors"\n'
        + '[indexes.broken.fields]\nid = "doc_key"\ntext = "content"\nvector = "embedding"\n')
    yield {"home": home, "es_index": es_index, "count": len(docs), "es": es}
    es.indices.delete(index=es_index, ignore_unavailable=True)
    es.close()


def _settings(foreign, index: str, **flags):
    return load_settings(foreign["home"] / "branchsearch.toml",
                         {"home": foreign["home"], "index": index, **flags}, read_env=False)


@pytest.mark.es
def test_every_mode_on_both_sides(foreign):
    r = open_retriever(_settings(foreign, "corp"))
    try:
        for mode in ("bm25", "dense", "hybrid"):
            hits = r.search("Ed Wood filmmaker director", mode=mode, k=5, acl_groups=["*"])
            assert hits, mode
            assert hits[0].doc_id in ("ed-wood", "ed-wood-film"), (mode, hits[0])
            assert all(h.chunk_id == f"{h.doc_id}#p0" and h.text for h in hits)
        grep = r.grep("filmmak.*", k=5, acl_groups=["*"])
        assert "ed-wood#p0" in [h.chunk_id for h in grep]
        seen = [h.chunk_id for h in r.search("Ed Wood", mode="hybrid", k=3, acl_groups=["*"])]
        again = r.search("Ed Wood", mode="hybrid", k=3, exclude_ids=seen, acl_groups=["*"])
        assert not set(seen) & {h.chunk_id for h in again}
        doc = r.read_document("ed-wood")
        assert doc["chunks"][0]["chunk_id"] == "ed-wood#p0"
        assert "filmmaker" in doc["chunks"][0]["text"]
        assert r.get_chunks(["ed-wood#p0"])["ed-wood#p0"]["title"] == "Ed Wood"
    finally:
        r.close()


@pytest.mark.es
def test_dense_exclusions_equal_the_full_ranking_without_them(foreign):
    """External Milvus drops excluded ids from a deeper search (no `not in` row filter): on an
    exact index the result is the full ranking less the exclusions, for every caller."""
    r = open_retriever(_settings(foreign, "corp_vec"))
    try:
        for groups in (None, ["film-dept"], ["*"]):
            for query in ("Ed Wood filmmaker director", "Scott Derrickson horror films"):
                full = [h.chunk_id for h in r.search(query, mode="dense", k=foreign["count"],
                                                     acl_groups=groups)]
                exclude = full[:2] + full[4:5]
                again = [h.chunk_id for h in r.search(query, mode="dense", k=4,
                                                      exclude_ids=exclude, acl_groups=groups)]
                assert again == [c for c in full if c not in exclude][:4], (groups, query)
                assert ("scott-derrickson#p0" in full) == (groups is not None)
    finally:
        r.close()


@pytest.mark.es
def test_acl_through_the_mapped_field(foreign):
    r = open_retriever(_settings(foreign, "corp"))
    try:
        for mode in ("bm25", "dense", "hybrid"):
            public = r.search("Scott Derrickson director", mode=mode, k=10)
            assert "scott-derrickson" not in {h.doc_id for h in public}, mode
            other = r.search("Scott Derrickson director", mode=mode, k=10, acl_groups=["hr"])
            assert "scott-derrickson" not in {h.doc_id for h in other}, mode
            member = r.search("Scott Derrickson director", mode=mode, k=10,
                              acl_groups=["film-dept"])
            assert "scott-derrickson" in {h.doc_id for h in member}, mode
        assert "scott-derrickson#p0" not in {h.chunk_id for h in r.grep("derrickson", k=5)}
        with pytest.raises(BadQuery, match="unknown document"):  # reads check before fetching
            r.read_document("scott-derrickson")
        with pytest.raises(BadQuery, match="unknown document"):
            r.read_document("scott-derrickson", acl_groups=["hr"])
        assert r.read_document("scott-derrickson", acl_groups=["film-dept"])["chunks"]
    finally:
        r.close()


@pytest.mark.es
def test_one_sided_indexes(foreign):
    lexical = open_retriever(_settings(foreign, "corp_es"), need_dense=False)
    try:
        assert lexical.search("Ed Wood", mode="hybrid", k=3)[0].source == "bm25"
        with pytest.raises(BadQuery, match="dense"):
            lexical.search("Ed Wood", mode="dense", k=3)
    finally:
        lexical.close()
    dense = open_retriever(_settings(foreign, "corp_vec"))
    try:
        assert dense.search("Ed Wood", mode="hybrid", k=3)[0].source == "dense"
        with pytest.raises(BadQuery, match="lexical backend"):
            dense.grep("wood", k=3)
        assert dense.read_document("ed-wood")["chunks"][0]["text"]
    finally:
        dense.close()
    # the CLI says why a hybrid search is one side's, in the external index's own terms
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "retrieve", "Ed Wood",
           "--home", str(foreign["home"]), "--index", "corp_es"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Ed Wood" in run.stdout, run.stderr[-800:]
    assert "its config maps no dense store" in run.stderr and "ingested" not in run.stderr


@pytest.mark.es
def test_mistakes_are_one_clear_error(foreign):
    with pytest.raises(SettingsError, match="8-dim vectors"):
        open_retriever(_settings(foreign, "tiny"))
    with pytest.raises(SettingsError, match="'content' is not in Milvus collection"):
        open_retriever(_settings(foreign, "broken"))
    with pytest.raises(SettingsError, match="unknown keys colour"):
        from branchsearch.infra.stores.external import parse_external

        parse_external("x", {"lexical": "elasticsearch", "es_index": "a", "colour": "red"})


@pytest.mark.es
def test_a_misspelt_acl_field_is_refused_not_read_as_public(foreign, tmp_path):
    """A document without groups is public, so an ACL field the backend lacks ("group" for
    "groups") would make every document public: it is one line at open, on Elasticsearch and
    on Milvus. `acl = ""` says the documents have no groups, and then every one is public."""
    settings_file = (foreign["home"] / "branchsearch.toml").read_text()
    mapped = ('[indexes.{n}.fields]\nid = "doc_key"\ntitle = "headline"\ntext = "body"\n'
              'acl = "{acl}"\nvector = "embedding"\n')
    es = f'lexical = "elasticsearch"\nes_index = "{foreign["es_index"]}"\n'
    (tmp_path / "branchsearch.toml").write_text(
        settings_file.split("[indexes.")[0]  # the backends' addresses
        + "[indexes.typo_es]\n" + es + mapped.format(n="typo_es", acl="group")
        + '[indexes.typo_vec]\ndense = "milvus"\nmilvus_collection = "corp_vectors"\n'
        + mapped.format(n="typo_vec", acl="group")
        + "[indexes.no_groups]\n" + es + mapped.format(n="no_groups", acl=""))

    def settings(index: str):
        return load_settings(tmp_path / "branchsearch.toml", {"home": tmp_path, "index": index},
                             read_env=False)

    for index, where in (("typo_es", "Elasticsearch index"), ("typo_vec", "Milvus collection")):
        with pytest.raises(SettingsError, match=f"field acl = 'group' is not in {where} .*"
                           r"groups.*set acl = \"\""):
            open_retriever(settings(index))
    r = open_retriever(settings("no_groups"))
    try:  # no groups declared: the document the groups field restricts is everyone's
        hits = r.search("Scott Derrickson director", mode="bm25", k=10, acl_groups=[])
        assert "scott-derrickson" in {h.doc_id for h in hits}
    finally:
        r.close()


@pytest.mark.es
def test_agent_search_and_no_writes(foreign):
    """The branch agent runs on the external index; ingest into it is refused; the foreign
    index holds exactly what it held before."""
    from branchsearch.orchestrator.driver import Driver

    settings = _settings(foreign, "corp")
    driver = Driver(settings, mode="local")
    try:
        result = driver.search("Were Scott Derrickson and Ed Wood of the same nationality?",
                               acl_groups=["film-dept"])
    finally:
        driver.close()
    found = {e["doc_id"] for e in result.evidence}
    assert {"ed-wood", "scott-derrickson"} <= found
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "ingest", str(HOTPOT),
           "--home", str(foreign["home"]), "--index", "corp"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "external" in run.stderr and "Traceback" not in run.stderr
    assert foreign["es"].count(index=foreign["es_index"])["count"] == foreign["count"]
    assert not (foreign["home"] / "indexes" / "corp").exists()  # not even a folder


@pytest.mark.es
def test_indexes_lists_owned_and_external(foreign, hotpot_settings):
    """`branchsearch indexes`: counts and health of each external index, one line per problem."""

    owned = foreign["home"] / "indexes" / "hotpot"
    if not owned.exists():  # an owned, complete index beside the external ones: its manifest
        # (only that: reading the session index's Milvus Lite lock file, even to copy it, would
        # drop this process's POSIX lock on it and stop the server other tests use)
        owned.mkdir(parents=True)
        copy_store(hotpot_settings.index_dir / "manifest.json", owned / "manifest.json")
        # and its store files by name (`indexes` checks they are there, not what they hold)
        for name in ("docs.sqlite", "tantivy/meta.json", "dense.db"):
            (owned / name).parent.mkdir(exist_ok=True)
            (owned / name).touch()
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "indexes", "--home",
           str(foreign["home"]), "--config", str(foreign["home"] / "branchsearch.toml"), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    # listed whole, and exit 1 for the two that cannot be searched (for health checks)
    assert run.returncode == 1, run.stderr
    infos = {i["name"]: i for i in json.loads(run.stdout)}
    assert run.stderr.strip() == "indexes: 2 not searchable now: tiny, broken", run.stderr
    assert infos["hotpot"]["kind"] == "owned" and infos["hotpot"]["health"] == "ok"
    assert infos["corp"]["health"] == "ok" and infos["corp"]["documents"] == foreign["count"]
    assert infos["corp_vec"]["documents"] == foreign["count"]
    assert "8-dim" in infos["tiny"]["health"]
    assert "'content'" in infos["broken"]["health"]


@pytest.mark.es
@pytest.mark.ray
def test_three_branches_through_ray_and_batch(foreign, tmp_path):
    """The Ray executor's retriever actor opens the external index from the settings it is
    sent; `batch` writes one ok line per question; the foreign index is unchanged."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"id": "q1", "question": "Were Scott Derrickson and Ed Wood of the same "
                                            "nationality?"}) + "\n"
        + json.dumps({"id": "q2", "question": "Who directed Ed Wood?"}) + "\n")
    base = [sys.executable, "-m", "branchsearch.orchestrator.cli"]
    where = ["--home", str(foreign["home"]), "--index", "corp"]
    search = subprocess.run(
        [*base, "search", "Were Scott Derrickson and Ed Wood of the same nationality?", *where,
         "--branches", "3", "--executor", "ray", "--acl", "film-dept", "--json"],
        capture_output=True, text=True, timeout=600)
    assert search.returncode == 0, search.stderr[-2000:]
    result = json.loads(search.stdout)
    assert result["status"] == "ok"
    assert {"ed-wood", "scott-derrickson"} <= {e["doc_id"] for e in result["evidence"]}
    out = tmp_path / "out.jsonl"
    batch = subprocess.run([*base, "batch", str(questions), "-o", str(out), *where,
                            "--executor", "local", "--branches", "1"],
                           capture_output=True, text=True, timeout=600)
    assert batch.returncode == 0, batch.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["q1", "q2"]
    assert all(r["status"] == "ok" and r["evidence"] for r in rows)
    # public only (no --acl): the restricted document never appears
    assert all("scott-derrickson" not in {e["doc_id"] for e in r["evidence"]} for r in rows)
    assert foreign["es"].count(index=foreign["es_index"])["count"] == foreign["count"]


def _batch_runner(tmp_path, questions: list[str]):
    """A function running `batch` over `questions` on index "corp" into out.jsonl, asserting
    exit 0 and returning its stderr; and the output's path."""
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{n}", "question": q}) + "\n"
                            for n, q in enumerate(questions)))
    out = tmp_path / "out.jsonl"
    batch = [sys.executable, "-m", "branchsearch.orchestrator.cli", "batch", str(path),
             "-o", str(out), "--home", str(tmp_path), "--index", "corp", "--executor", "local",
             "--branches", "1"]

    def run() -> str:
        done = subprocess.run(batch, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    return run, out


_MEMOS = {"heron-memo": {"body": "The heron survey counts 40 nests in March."},
          "tern-memo": {"body": "The tern survey counts 12 nests in May."}}
_MEMO_MAPPING = {"properties": {"doc_key": {"type": "keyword"}, "body": {"type": "text"},
                                "groups": {"type": "keyword"}}}


@pytest.mark.es
def test_a_resumed_batch_on_an_external_index_asks_again_after_its_documents_changed(
        es_url, tmp_path):
    """An external index has no manifest; a batch's rows on one over Elasticsearch carry the
    index's fingerprint as `index_version`: a resume with nothing changed keeps them, one after
    a document was updated in place asks them again and says why, so no row keeps evidence
    quoting the old text."""
    from elasticsearch import Elasticsearch

    settings = _es_index(es_url, tmp_path, _MEMO_MAPPING, _MEMOS, "groups")
    run, out = _batch_runner(tmp_path, ["heron survey nests", "tern survey nests"])
    assert "external" not in run()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    versions = {r["index_version"] for r in rows}
    assert all(r["status"] == "ok" for r in rows) and len(versions) == 1, rows
    assert next(iter(versions)).startswith("es-"), versions
    said = run()  # nothing changed: kept, and nothing to say
    assert "asking again" not in said and "external" not in said, said
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    es = Elasticsearch(es_url)
    es.index(index=settings.external.es_index, id="heron-memo", refresh=True, document={
        "doc_key": "heron-memo", "body": "The heron survey counts 55 nests in March."})
    es.close()
    said = [line for line in run().splitlines() if "asking again" in line or "external" in line]
    assert said == ["asking again 2 question(s) whose ok row was answered before the documents "
                    "of 'corp' changed (a write in its Elasticsearch index)"], said
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["index_version"] for r in again} - versions == {r["index_version"] for r in again}
    heron = next(r for r in again if r["id"] == "q0")
    assert "55 nests" in json.dumps(heron["evidence"]), heron  # the new text, not the old
    assert "40 nests" not in json.dumps(heron["evidence"]), heron


@pytest.mark.es
def test_an_update_a_delete_and_an_add_each_move_the_fingerprint(es_url, tmp_path):
    """Each write to the Elasticsearch index (an update in place keeps the count, so only the
    shard's sequence number tells it) gives another version; reading gives the same one."""
    from elasticsearch import Elasticsearch

    from branchsearch.infra.index.fingerprint import external_version

    settings = _es_index(es_url, tmp_path, _MEMO_MAPPING, _MEMOS, "groups",
                         {"number_of_shards": 3})
    name, es = settings.external.es_index, Elasticsearch(es_url)
    seen = [external_version(settings.external, settings)]
    assert seen[0][0].startswith("es-") and seen[0][1] == "", seen
    assert external_version(settings.external, settings) == seen[0]
    for write in (lambda: es.index(index=name, id="tern-memo", refresh=True, document={
                      "doc_key": "tern-memo", "body": "The tern survey counts 13 nests."}),
                  lambda: es.delete(index=name, id="tern-memo", refresh=True),
                  lambda: es.index(index=name, id="gull-memo", refresh=True, document={
                      "doc_key": "gull-memo", "body": "The gull survey counts 7 nests."})):
        write()
        seen.append(external_version(settings.external, settings))
    es.close()
    assert len({v for v, _ in seen}) == 4 and all(v for v, _ in seen), seen


def test_an_index_with_a_milvus_side_has_no_fingerprint_and_says_which_side():
    """A Milvus collection has no number that every write moves: a hybrid index's version is
    not made from its Elasticsearch side alone; the reason names the Milvus side."""
    from branchsearch.infra.index.fingerprint import external_version
    from branchsearch.infra.stores.external import parse_external

    hybrid = parse_external("corp", {"lexical": "elasticsearch", "es_index": "corp-docs",
                                     "dense": "milvus", "milvus_collection": "corp_vec"})
    dense = parse_external("corp", {"dense": "milvus", "milvus_collection": "corp_vec"})
    assert external_version(hybrid, None) == ("", "its Milvus side (collection 'corp_vec')")
    assert external_version(dense, None) == ("", "its cluster (collection 'corp_vec')")


def test_stats_without_every_primary_shard_give_no_fingerprint():
    """A shard whose primary did not answer (or a failed shard) leaves nothing to tell a change
    by on it: no fingerprint is made from the others."""
    from branchsearch.infra.index.fingerprint import es_fingerprint

    def shard(primary: bool, seq: int) -> dict:
        return {"routing": {"primary": primary}, "seq_no": {"max_seq_no": seq},
                "docs": {"count": 2}}

    whole = {"_shards": {"failed": 0}, "indices": {"x": {"uuid": "u", "shards": {
        "0": [shard(True, 4), shard(False, 4)], "1": [shard(True, 9)]}}}}
    assert es_fingerprint(whole).startswith("es-")
    no_primary = json.loads(json.dumps(whole))
    no_primary["indices"]["x"]["shards"]["1"] = [shard(False, 9)]
    failed = json.loads(json.dumps(whole)) | {"_shards": {"failed": 1}}
    assert es_fingerprint(no_primary) == es_fingerprint(failed) == ""
    moved = json.loads(json.dumps(whole))  # the same maximum, another shard's write
    moved["indices"]["x"]["shards"]["0"][0]["seq_no"]["max_seq_no"] = 5
    assert es_fingerprint(moved) not in ("", es_fingerprint(whole))


@pytest.mark.es
def test_rows_written_without_a_version_on_an_external_index_are_kept_and_said(
        es_url, tmp_path):
    """Rows an earlier batch wrote on an external index carry no `index_version`: nothing
    tells what they were answered on, so they are kept, and the resume says so once."""
    _es_index(es_url, tmp_path, _MEMO_MAPPING, _MEMOS, "groups")
    run, out = _batch_runner(tmp_path, ["heron survey nests", "tern survey nests"])
    run()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        del row["index_version"]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = [line for line in run().splitlines() if "index_version" in line or "again" in line]
    assert said == ["resumed: 2 answered row(s) kept that carry no index_version (written "
                    "before index 'corp' had one): changes to its cluster before this run are "
                    "not detected for them — give another -o (or remove the output) to ask "
                    "them again"], said
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_an_l2_collection_ranks_the_nearest_first(tmp_path):
    """Milvus's L2 `distance` is smaller for a nearer vector; scored as it came, the ranking
    (ordered by score, highest first) put the farthest document first."""
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder

    docs = {d["_id"]: d for d in _docs()}
    ids = ["ed-wood", "scott-derrickson", "shirley-temple"]
    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu")
    vectors = embedder.embed([f"{docs[i]['title']}\n{docs[i]['text']}" for i in ids])
    uri = str(tmp_path / "l2.db")
    client = MilvusClient(uri=uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("text", DataType.VARCHAR, max_length=8192)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=embedder.dim)
    index = client.prepare_index_params()
    index.add_index(field_name="vector", index_type="FLAT", metric_type="L2")
    client.create_collection("l2_vectors", schema=schema, index_params=index)
    client.insert("l2_vectors", [{"id": i, "text": docs[i]["text"], "vector": v.tolist()}
                                 for i, v in zip(ids, vectors)])
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    (tmp_path / "branchsearch.toml").write_text(
        f'milvus_uri = "{uri}"\n[indexes.l2]\ndense = "milvus"\nmilvus_collection = '
        '"l2_vectors"\n[indexes.l2.fields]\nacl = ""\n')
    r = open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                     {"home": tmp_path, "index": "l2"}, read_env=False))
    try:
        for doc_id in ids:  # a document's own text is nearest to itself
            hits = r.search(f"{docs[doc_id]['title']}\n{docs[doc_id]['text']}", mode="dense",
                            k=3, acl_groups=["*"])
            assert hits[0].doc_id == doc_id, [(h.doc_id, h.score) for h in hits]
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    finally:
        r.close()


@pytest.fixture
def dynamic_es(es_url, tmp_path):
    """An index mapped by Elasticsearch itself (strings: text + `.keyword`) and one with the
    groups in an object ("meta.groups"); one document for group 'finance-eu', one public."""
    from elasticsearch import Elasticsearch

    es = Elasticsearch(es_url)
    names = [f"dyn-{uuid.uuid4().hex[:8]}", f"obj-{uuid.uuid4().hex[:8]}"]
    es.indices.create(index=names[1], mappings={"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "meta": {"properties": {"groups": {"type": "keyword"}}}}})
    for name in names:
        for key, groups in (("secret-plan", ["finance-eu"]), ("public-memo", [])):
            acl = {"meta": {"groups": groups}} if name == names[1] else {"groups": groups}
            es.index(index=name, id=key, document={"doc_key": key, "body": f"the {key} budget",
                                                   **acl})
        es.indices.refresh(index=name)
    index = ('[indexes.{n}]\nlexical = "elasticsearch"\nes_index = "{i}"\n[indexes.{n}.fields]\n'
             'id = "{id}"\ntitle = "body"\ntext = "body"\nacl = "{acl}"\n')
    (tmp_path / "branchsearch.toml").write_text(
        f'es_url = "{es_url}"\n'
        + index.format(n="text_acl", i=names[0], id="doc_key.keyword", acl="groups")
        + index.format(n="keyword_acl", i=names[0], id="doc_key.keyword", acl="groups.keyword")
        + index.format(n="object_acl", i=names[1], id="doc_key", acl="meta.groups"))
    yield lambda index: load_settings(tmp_path / "branchsearch.toml",
                                      {"home": tmp_path, "index": index}, read_env=False)
    for name in names:
        es.indices.delete(index=name, ignore_unavailable=True)
    es.close()


@pytest.mark.es
def test_a_text_acl_field_is_refused_not_matched_word_by_word(dynamic_es):
    """An analysed (text) ACL field matches group names word by word: a caller of group 'eu'
    saw the document of 'finance-eu'. It is refused at open, naming its keyword sub-field."""
    with pytest.raises(SettingsError, match=r"acl = 'groups' is a text field.*"
                       r"acl = 'groups.keyword'"):
        open_retriever(dynamic_es("text_acl"))


@pytest.mark.es
def test_acl_in_a_sub_field_or_an_object_is_read_from_the_source(dynamic_es):
    """A multi-field ("groups.keyword") or an object's field ("meta.groups") is not a key of
    `_source`: read as missing, every document read was public to every caller."""
    for index in ("keyword_acl", "object_acl"):
        r = open_retriever(dynamic_es(index))
        try:
            for groups, sees in (([], False), (["eu"], False), (["finance-eu"], True)):
                hits = r.search("secret plan budget", mode="bm25", k=5, acl_groups=groups)
                assert ("secret-plan" in {h.doc_id for h in hits}) == sees, (index, groups)
                assert "public-memo" in {h.doc_id for h in hits}, (index, groups)
                _assert_read(r, "secret-plan", groups, sees)
            assert r.read_document("public-memo")["chunks"][0]["text"] == "the public-memo budget"
        finally:
            r.close()


def _es_index(es_url, tmp_path, mappings: dict, documents: dict[str, dict], acl: str,
              index_settings: dict | None = None):
    """One Elasticsearch index made with `mappings` (and `index_settings`), holding `documents`
    (id -> _source), declared as index "corp" (id "doc_key", text "body", acl `acl`); its
    settings."""
    from elasticsearch import Elasticsearch

    es = Elasticsearch(es_url)
    name = f"corp-{uuid.uuid4().hex[:8]}"
    es.indices.create(index=name, mappings=mappings, settings=index_settings)
    for key, source in documents.items():
        es.index(index=name, id=key, document={"doc_key": key, **source})
    es.indices.refresh(index=name)
    es.close()
    (tmp_path / "branchsearch.toml").write_text(
        f'es_url = "{es_url}"\n[indexes.corp]\nlexical = "elasticsearch"\nes_index = "{name}"\n'
        f'[indexes.corp.fields]\nid = "doc_key"\ntitle = "body"\ntext = "body"\nacl = "{acl}"\n')
    return load_settings(tmp_path / "branchsearch.toml", {"home": tmp_path, "index": "corp"},
                         read_env=False)


@pytest.mark.es
def test_an_alias_acl_field_is_searched_and_read_as_its_target(es_url, tmp_path):
    """A field alias (`groups` -> `real_groups`) holds no values in `_source`: read as missing,
    the restricted document was public to every caller (search on the emulator, read_document
    on Elasticsearch). It is searched and read as the field it points to."""
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "real_groups": {"type": "keyword"}, "groups": {"type": "alias", "path": "real_groups"}}},
        {"secret-plan": {"body": "the secret-plan budget", "real_groups": ["finance"]},
         "public-memo": {"body": "the public-memo budget"}}, "groups")
    r = open_retriever(settings)
    try:
        for groups, sees in ((None, False), (["hr"], False), (["finance"], True)):
            hits = {h.doc_id for h in r.search("secret plan budget", mode="bm25", k=5,
                                                acl_groups=groups)}
            assert ("secret-plan" in hits) == sees and "public-memo" in hits, groups
            _assert_read(r, "secret-plan", groups, sees)
    finally:
        r.close()


@pytest.mark.es
def test_an_acl_field_source_does_not_hold_is_refused(es_url, tmp_path):
    """Groups filled by `copy_to` (or excluded from `_source`) are indexed, so searches filter
    on them, but a read by id takes the ACL from `_source`, where they are not: the restricted
    document read as public (and on the emulator, which copies nothing, was public in search
    too). Refused at open, saying why."""
    keyword = {"doc_key": {"type": "keyword"}, "body": {"type": "text"}}
    copied = _es_index(es_url, tmp_path, {"properties": {
        **keyword, "owner": {"type": "keyword", "copy_to": "groups"},
        "groups": {"type": "keyword"}}},
        {"secret-plan": {"body": "the secret-plan budget", "owner": "finance"}}, "groups")
    with pytest.raises(SettingsError, match=r"acl = 'groups' is filled by copy_to from "
                       r"'owner'.*read as public"):
        open_retriever(copied)
    for source in ({"excludes": ["meta.groups"]}, {"excludes": ["meta*"]}, {"includes": ["body"]},
                   {"enabled": False}):
        hidden = _es_index(es_url, tmp_path, {"_source": source, "properties": {
            **keyword, "meta": {"properties": {"groups": {"type": "keyword"}}}}},
            {"secret-plan": {"body": "the secret-plan budget",
                             "meta": {"groups": ["finance"]}}}, "meta.groups")
        with pytest.raises(SettingsError, match=r"acl = 'meta.groups' is not in _source"):
            open_retriever(hidden)
    kept = _es_index(es_url, tmp_path, {"_source": {"excludes": ["body_vector"]}, "properties": {
        **keyword, "meta": {"properties": {"groups": {"type": "keyword"}}}}},
        {"secret-plan": {"body": "the secret-plan budget", "meta": {"groups": ["finance"]}}},
        "meta.groups")
    r = open_retriever(kept)
    try:
        with pytest.raises(BadQuery, match="unknown document"):
            r.read_document("secret-plan")
        assert r.read_document("secret-plan", acl_groups=["finance"])["chunks"]
    finally:
        r.close()


@pytest.mark.es
def test_an_acl_field_with_a_normalizer_is_refused(es_url, tmp_path):
    """A keyword field with a (lowercase) normalizer indexes 'HR' as 'hr', and a terms query is
    normalised too: a caller of group 'hr' found the documents of group 'HR' (read_document,
    which compares names exactly, refused them). Refused at open, as a text field is."""
    lowercase = {"analysis": {"normalizer": {"lc": {"type": "custom", "filter": ["lowercase"]}}}}
    for groups, acl in (({"type": "keyword", "normalizer": "lc"}, "groups"),
                        ({"type": "text", "fields": {"kw": {"type": "keyword",
                                                            "normalizer": "lc"}}}, "groups.kw")):
        settings = _es_index(es_url, tmp_path, {"properties": {
            "doc_key": {"type": "keyword"}, "body": {"type": "text"}, "groups": groups}},
            {"secret-plan": {"body": "the secret-plan budget", "groups": ["HR"]}}, acl,
            lowercase)
        with pytest.raises(SettingsError, match=rf"acl = '{acl}' has the normalizer 'lc'"):
            open_retriever(settings)


@pytest.mark.es
def test_a_null_among_a_documents_groups_is_no_group_not_a_crash(es_url, tmp_path):
    """`["finance", null]` in a document's ACL array: a read by id crashed on the null (None
    has no strip); it is no group, so the document is finance's, and `[null]` alone is public,
    as the backend's own filter counts it."""
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "groups": {"type": "keyword"}}},
        {"secret-plan": {"body": "the secret-plan budget", "groups": ["finance", None]},
         "null-memo": {"body": "the null-memo budget", "groups": [None]}}, "groups")
    r = open_retriever(settings)
    try:
        with pytest.raises(BadQuery, match="unknown document"):
            r.read_document("secret-plan", acl_groups=["hr"])
        assert r.read_document("secret-plan", acl_groups=["finance"])["chunks"]
        assert r.read_document("null-memo", acl_groups=["hr"])["chunks"]
    finally:
        r.close()


@pytest.mark.es
def test_an_alias_is_checked_index_by_index(es_url, tmp_path):
    """`es_index` an alias over two indexes whose teams mapped the groups differently: the
    mappings were merged, one index's `groups` (keyword) hid the other's (text), and there a
    caller of group 'eu' found the document of group 'finance-eu'. Each index behind the alias
    is checked; an alias whose indexes all map keyword groups is searched as one index, under
    the ids and groups its documents have."""
    from elasticsearch import Elasticsearch

    es = Elasticsearch(es_url)
    tag = uuid.uuid4().hex[:8]
    keyword = {"doc_key": {"type": "keyword"}, "body": {"type": "text"},
               "groups": {"type": "keyword"}}
    analysed = {**keyword, "groups": {"type": "text", "fields": {"kw": {"type": "keyword"}}}}
    made = {f"aa-{tag}": analysed, f"ab-{tag}": {k: v for k, v in keyword.items()
                                                 if k != "groups"},
            f"zz-{tag}": keyword, f"zy-{tag}": keyword}
    documents = {f"aa-{tag}": {"eu-plan": ["finance-eu"]}, f"ab-{tag}": {"ab-memo": None},
                 f"zz-{tag}": {"Zürich/1#a": "finance-eu", "öffentlich": []},
                 f"zy-{tag}": {"東京-plan": ["finance"]}}
    for name, mappings in made.items():
        es.indices.create(index=name, mappings={"properties": mappings})
        for key, groups in documents[name].items():
            groups = {} if groups is None else {"groups": groups}
            es.index(index=name, id=f"es-{key}", document={"doc_key": key,
                                                            "body": f"the {key} budget", **groups})
        es.indices.refresh(index=name)
    for alias, members in ((f"mixed-{tag}", ("aa", "zz")), (f"partial-{tag}", ("ab", "zz")),
                           (f"same-{tag}", ("zy", "zz"))):
        for member in members:
            es.indices.put_alias(index=f"{member}-{tag}", name=alias)
    es.close()

    def settings(alias: str):
        (tmp_path / "branchsearch.toml").write_text(
            f'es_url = "{es_url}"\n[indexes.corp]\nlexical = "elasticsearch"\n'
            f'es_index = "{alias}"\n[indexes.corp.fields]\nid = "doc_key"\ntitle = "body"\n'
            'text = "body"\nacl = "groups"\n')
        return load_settings(tmp_path / "branchsearch.toml", {"home": tmp_path, "index": "corp"},
                             read_env=False)

    with pytest.raises(SettingsError, match=rf"acl = 'groups' is a text field in Elasticsearch "
                       rf"index 'aa-{tag}' \(behind 'mixed-{tag}'\)"):
        open_retriever(settings(f"mixed-{tag}"))
    with pytest.raises(SettingsError, match=rf"acl = 'groups' is not in Elasticsearch index "
                       rf"'ab-{tag}' \(behind 'partial-{tag}'\): each of its documents would "
                       "read as public"):
        open_retriever(settings(f"partial-{tag}"))
    r = open_retriever(settings(f"same-{tag}"))
    try:
        for groups, sees in ((None, {"öffentlich"}), (["eu"], {"öffentlich"}),
                             (["finance-eu"], {"öffentlich", "Zürich/1#a"}),
                             (["finance"], {"öffentlich", "東京-plan"})):
            hits = r.search("budget plan", mode="bm25", k=10, acl_groups=groups)
            assert {h.doc_id for h in hits} == sees, groups
            assert all(h.chunk_id == f"{h.doc_id}#p0" for h in hits)
        assert r.read_document("Zürich/1#a", acl_groups=["finance-eu"])["chunks"]
        with pytest.raises(BadQuery, match="unknown document"):
            r.read_document("Zürich/1#a", acl_groups=["finance"])
    finally:
        r.close()


def test_a_milvus_acl_or_vector_field_of_another_type_is_refused_at_open(tmp_path):
    """Another team's collection keeps its groups in a JSON field (a string in one row, a list
    in another) or in a number: the index opened, and every search then failed in Milvus's
    expression parser ("Invalid expr: acl == \\"\\""), the caller seeing a backend error per
    question. A vector field mapped to a text field read as "0-dim vectors". Both are one line
    at open, naming the field's type."""
    from pymilvus import DataType, MilvusClient

    uri = str(tmp_path / "corp.db")
    client = MilvusClient(uri=uri)
    for collection, acl_type in (("json_acl", DataType.JSON), ("int_acl", DataType.INT64),
                                 ("int_array_acl", DataType.ARRAY)):
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("body_text", DataType.VARCHAR, max_length=1024)
        extra = ({"element_type": DataType.INT64, "max_capacity": 4}
                 if acl_type == DataType.ARRAY else {})
        schema.add_field("acl", acl_type, **extra)
        schema.add_field("emb", DataType.FLOAT_VECTOR, dim=384)
        index = client.prepare_index_params()
        index.add_index(field_name="emb", index_type="FLAT", metric_type="COSINE")
        client.create_collection(collection, schema=schema, index_params=index)
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    declared = ('[indexes.{n}]\ndense = "milvus"\nmilvus_collection = "{c}"\n'
                '[indexes.{n}.fields]\nid = "doc_key"\ntext = "body_text"\nacl = "acl"\n'
                'vector = "{v}"\n')
    (tmp_path / "branchsearch.toml").write_text(
        f'milvus_uri = "{uri}"\n' + "".join(declared.format(n=c, c=c, v="emb") for c in (
            "json_acl", "int_acl", "int_array_acl"))
        + declared.format(n="text_vec", c="int_acl", v="body_text"))

    def opened(name: str):
        return open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                            {"home": tmp_path, "index": name}, read_env=False))

    for name, shown in (("json_acl", "JSON"), ("int_acl", "INT64"),
                        ("int_array_acl", "ARRAY of INT64")):
        with pytest.raises(SettingsError, match=rf"index '{name}': field acl = 'acl' is {shown} "
                           rf"in Milvus collection '{name}'; the group names must be a VARCHAR"):
            opened(name)
    with pytest.raises(SettingsError, match=r"field vector = 'body_text' is not a dense vector "
                       r"field in Milvus collection 'int_acl' \(it is VARCHAR\)"):
        opened("text_vec")


@pytest.mark.es
def test_an_acl_field_that_is_not_keyword_is_refused(es_url, tmp_path):
    """`acl = "acl"` naming an object (`{"groups": [...], "users": [...]}`): no search matched
    it, but a read by id took the object's keys for its groups, so a caller of group 'users'
    read the document of group 'finance'. Numbers fail every query that names a group. The
    ACL field must be a keyword field; the refusal names a keyword sub-field to use."""
    for props, acl, shown, use in (
            ({"properties": {"groups": {"type": "keyword"}, "users": {"type": "keyword"}}},
             "acl", "object", "acl = 'acl.groups'"),
            ({"type": "nested", "properties": {"name": {"type": "keyword"}}}, "acl", "nested",
             "acl = 'acl.name'"),
            ({"type": "long"}, "acl", "long", "a keyword field")):
        settings = _es_index(es_url, tmp_path, {"properties": {
            "doc_key": {"type": "keyword"}, "body": {"type": "text"}, "acl": props}},
            {"public-memo": {"body": "the public-memo budget"}}, acl)
        with pytest.raises(SettingsError, match=rf"acl = 'acl' is of type '{shown}' in "
                           rf"Elasticsearch index 'corp-\w+'; the group names must be a keyword "
                           rf"field: use {use} in \[indexes.corp.fields\]"):
            open_retriever(settings)
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"}, "acl": {"properties": {
            "groups": {"type": "keyword"}, "users": {"type": "keyword"}}}}},
        {"secret-plan": {"body": "the secret-plan budget",
                         "acl": {"groups": ["finance"], "users": ["bob"]}}}, "acl.groups")
    r = open_retriever(settings)
    try:
        for groups in (["users"], ["groups"], ["bob"]):
            with pytest.raises(BadQuery, match="unknown document"):
                r.read_document("secret-plan", acl_groups=groups)
        assert r.read_document("secret-plan", acl_groups=["finance"])["chunks"]
        assert [h.doc_id for h in r.search("secret plan", mode="bm25", k=3,
                                           acl_groups=["finance"])] == ["secret-plan"]
    finally:
        r.close()


def test_a_collection_whose_ids_are_integers_is_read_by_id(tmp_path):
    """Many collections key their rows by an INT64 primary key. Searches found its rows, but
    every read by id (the agent's read tool, the evidence's text) and a long exclusion list
    sent the ids as strings, and Milvus failed the query ("query failed (MilvusException:
    ... kInt64Val ...)"), shown as a backend error. Integer ids are sent as numbers; an id that
    is no integer is an unknown document; an id field of another type is refused at open."""
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder
    from branchsearch.infra.stores.protocols import MAX_K

    rows = {101: ("the zurich budget for finance", "finance"), 102: ("the public memo", ""),
            103: ("the tokyo budget plan", "finance-eu")}
    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu")
    vectors = embedder.embed([text for text, _ in rows.values()])
    uri = str(tmp_path / "corp.db")
    client = MilvusClient(uri=uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("pk", DataType.INT64, is_primary=True)
    schema.add_field("body_text", DataType.VARCHAR, max_length=1024)
    schema.add_field("groups", DataType.VARCHAR, max_length=64)
    schema.add_field("score", DataType.FLOAT)
    schema.add_field("emb", DataType.FLOAT_VECTOR, dim=embedder.dim)
    index = client.prepare_index_params()
    index.add_index(field_name="emb", index_type="FLAT", metric_type="COSINE")
    client.create_collection("int_ids", schema=schema, index_params=index)
    client.insert("int_ids", [{"pk": pk, "body_text": text, "groups": groups, "score": 0.5,
                               "emb": v.tolist()} for (pk, (text, groups)), v in
                              zip(rows.items(), vectors)])
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    declared = ('[indexes.{n}]\ndense = "milvus"\nmilvus_collection = "int_ids"\n'
                '[indexes.{n}.fields]\nid = "{i}"\ntext = "body_text"\nacl = "groups"\n'
                'vector = "emb"\n')
    (tmp_path / "branchsearch.toml").write_text(
        f'milvus_uri = "{uri}"\n' + declared.format(n="corp", i="pk")
        + declared.format(n="float_ids", i="score"))

    def opened(name: str):
        return open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                            {"home": tmp_path, "index": name}, read_env=False))

    with pytest.raises(SettingsError, match=r"field id = 'score' is FLOAT in Milvus collection "
                       r"'int_ids'; a document id must be a VARCHAR or an integer field"):
        opened("float_ids")
    r = opened("corp")
    try:
        doc = r.read_document("101", acl_groups=["finance"])
        assert doc["chunks"][0]["text"] == "the zurich budget for finance"
        for doc_id, groups in (("101", ["hr"]), ("103", None), ("abc", ["*"]),
                               ("99999999999999999999", ["*"])):
            with pytest.raises(BadQuery, match="unknown document"):
                r.read_document(doc_id, acl_groups=groups)
        hits = r.search("budget", mode="dense", k=3, acl_groups=["finance-eu"])
        assert {h.doc_id for h in hits} == {"102", "103"}
        many = [f"x{i}#p0" for i in range(MAX_K)] + ["103#p0"]  # past MAX_K: in the filter
        hits = r.search("budget", mode="dense", k=3, exclude_ids=many, acl_groups=["*"])
        assert {h.doc_id for h in hits} == {"101", "102"}
    finally:
        r.close()


def test_a_collection_without_a_vector_index_is_refused_at_open(tmp_path):
    """A collection created without an index on its vector field opened on Milvus Lite, and
    each search then failed ("search failed (MilvusException: No index found in field [emb]:
    index not found)"), a backend error per question. One line at open instead."""
    from pymilvus import DataType, MilvusClient

    uri = str(tmp_path / "corp.db")
    client = MilvusClient(uri=uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=64)
    schema.add_field("body_text", DataType.VARCHAR, max_length=1024)
    schema.add_field("emb", DataType.FLOAT_VECTOR, dim=384)
    client.create_collection("no_index", schema=schema)
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    (tmp_path / "branchsearch.toml").write_text(
        f'milvus_uri = "{uri}"\n[indexes.corp]\ndense = "milvus"\nmilvus_collection = '
        '"no_index"\n[indexes.corp.fields]\nid = "doc_key"\ntext = "body_text"\nacl = ""\n'
        'vector = "emb"\n')
    with pytest.raises(SettingsError, match=r"index 'corp': Milvus collection 'no_index' has no "
                       r"index on its vector field 'emb', so Milvus cannot search it"):
        open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                     {"home": tmp_path, "index": "corp"}, read_env=False))
    client = MilvusClient(uri=uri)  # the refused open let go of the Lite file
    assert client.has_collection("no_index")
    client.close()


@pytest.mark.es
def test_an_acl_keyword_field_with_ignore_above_is_refused(es_url, tmp_path):
    """A keyword ACL field with `ignore_above: 10` does not index the group
    'finance-emea-restricted': Elasticsearch's `exists` does not match that document, so the
    filter took it for public and every caller found it (on the emulator, which keeps
    `exists`, no group holder found it). Refused at open; the same limit on a multi-field
    ("groups.keyword" under a text "groups", as dynamic mapping makes it) is kept: `exists`
    asks the text field, which indexes every group."""
    for groups, acl, refused in (
            ({"type": "keyword", "ignore_above": 10}, "groups", True),
            ({"type": "text", "fields": {"keyword": {"type": "keyword", "ignore_above": 256}}},
             "groups.keyword", False)):
        settings = _es_index(es_url, tmp_path, {"properties": {
            "doc_key": {"type": "keyword"}, "body": {"type": "text"}, "groups": groups}},
            {"long-secret": {"body": "the long-secret budget",
                             "groups": ["finance-emea-restricted"]}}, acl)
        if refused:
            with pytest.raises(SettingsError, match=r"acl = 'groups' has ignore_above = 10 in "
                               r"Elasticsearch index 'corp-\w+': a document whose group is "
                               "longer is indexed without it and would read as public"):
                open_retriever(settings)
            continue
        r = open_retriever(settings)
        try:
            assert not r.search("long secret budget", mode="bm25", k=3, acl_groups=["hr"])
        finally:
            r.close()


# every shape an Elasticsearch ACL field may hold -> who sees the document (search and read)
ACL_SHAPES = {
    "missing-memo": ({}, {"anyone"}),
    "null-memo": ({"groups": None}, {"anyone"}),
    "empty-list-memo": ({"groups": []}, {"anyone"}),
    "nulls-memo": ({"groups": [None]}, {"anyone"}),
    "empty-string-memo": ({"groups": ""}, set()),
    "empty-strings-memo": ({"groups": [""]}, set()),
    "blank-memo": ({"groups": " "}, set()),
    "finance-or-empty-memo": ({"groups": ["finance", ""]}, {"finance"}),
    "finance-or-null-memo": ({"groups": ["finance", None]}, {"finance"}),
    "finance-memo": ({"groups": "finance"}, {"finance"}),
}


@pytest.mark.es
def test_every_acl_shape_is_seen_by_the_same_callers_in_search_and_read(es_url, tmp_path):
    """`acl: ""` (or `[""]`) was hidden from every caller by search but public when read by
    id. One rule for every shape: null and missing values are no group, so a field with none
    is public; an empty or blank string is a group no caller can hold (admins only)."""
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "groups": {"type": "keyword"}}},
        {key: {"body": f"the {key} budget", **source} for key, (source, _) in ACL_SHAPES.items()},
        "groups")
    r = open_retriever(settings)
    try:
        _assert_shapes_seen(r, ACL_SHAPES, "budget memo", "bm25", 20)
    finally:
        r.close()


@pytest.mark.es
def test_an_acl_field_with_a_null_value_is_refused(es_url, tmp_path):
    """`null_value` indexes a null as a group: search would restrict `groups: null` to that
    group while a read by id finds no group in `_source` and shows the document to everyone.
    Refused at open, as a normalizer is."""
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "groups": {"type": "keyword", "null_value": "staff"}}},
        {"staff-memo": {"body": "the staff-memo budget", "groups": None}}, "groups")
    with pytest.raises(SettingsError, match=r"acl = 'groups' has null_value = 'staff'"):
        open_retriever(settings)


# doc id -> (its groups in Elasticsearch, its groups in Milvus): stores that disagree
DISAGREEING = {"lexical-restricts": (["finance"], []), "dense-restricts": ([], ["finance"]),
               "both-restrict-otherwise": (["finance"], ["hr"]), "both-agree": (["hr"], ["hr"]),
               "both-public": ([], [])}


@pytest.mark.es
def test_a_hybrid_index_whose_stores_disagree_on_acl_follows_the_stricter(es_url, tmp_path):
    """Elasticsearch restricts a document that the Milvus collection holds as public (or the
    reverse): a dense hit showed it, text and all, to a caller the lexical store hides it
    from, and a read by id went by the lexical store only. Each side's hits and each read are
    now checked against both stores: a caller sees a document only where both let it, and
    two stores naming different groups show it to admins only."""
    from elasticsearch import Elasticsearch
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder

    docs = {d["_id"]: d for d in _docs()}
    pages = ["ed-wood", "scott-derrickson", "shirley-temple", "sinister-film", "woodson-arkansas"]
    text = {key: f"{docs[d]['title']} {docs[d]['text']} budget"
            for key, d in zip(DISAGREEING, pages)}
    es = Elasticsearch(es_url)
    name = f"corp-{uuid.uuid4().hex[:8]}"
    es.indices.create(index=name, mappings={"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"}, "groups": {"type": "keyword"}}})
    for key, (groups, _) in DISAGREEING.items():
        es.index(index=name, id=key, document={"doc_key": key, "body": text[key],
                                               "groups": groups})
    es.indices.refresh(index=name)
    es.close()
    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu")
    vectors = embedder.embed([text[key] for key in DISAGREEING])
    uri = str(tmp_path / "corp.db")
    client = MilvusClient(uri=uri)
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("doc_key", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("body", DataType.VARCHAR, max_length=8192)
    schema.add_field("groups", DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=8,
                     max_length=64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=embedder.dim)
    index = client.prepare_index_params()
    index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
    client.create_collection("corp_vectors", schema=schema, index_params=index)
    client.insert("corp_vectors", [{"doc_key": key, "body": text[key], "groups": dense,
                                    "vector": v.tolist()}
                                   for (key, (_, dense)), v in zip(DISAGREEING.items(), vectors)])
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    (tmp_path / "branchsearch.toml").write_text(
        f'es_url = "{es_url}"\nmilvus_uri = "{uri}"\n[indexes.corp]\nlexical = "elasticsearch"\n'
        f'es_index = "{name}"\ndense = "milvus"\nmilvus_collection = "corp_vectors"\n'
        '[indexes.corp.fields]\nid = "doc_key"\ntitle = "body"\ntext = "body"\nacl = "groups"\n')
    settings = load_settings(tmp_path / "branchsearch.toml", {"home": tmp_path, "index": "corp"},
                             read_env=False)
    seen_by = {"lexical-restricts": {"finance"}, "dense-restricts": {"finance"},
               "both-restrict-otherwise": set(), "both-agree": {"hr"},
               "both-public": {"nobody", "finance", "hr"}}
    for need_dense in (True, False):
        r = open_retriever(settings, need_dense=need_dense)
        try:
            for caller, groups in CALLERS:
                for mode in ("bm25", "dense", "hybrid") if need_dense else ("bm25",):
                    found = {h.doc_id for h in r.search("budget", mode=mode, k=10,
                                                         acl_groups=groups)}
                    want = {k for k, who in seen_by.items() if caller in who or caller == "admin"}
                    assert found == want, (caller, mode)
                for key, who in seen_by.items():
                    sees = caller in who or caller == "admin"
                    _assert_read(r, key, groups, sees, (caller, key))
        finally:
            r.close()


@pytest.mark.es
def test_a_bad_indexes_table_makes_only_that_index_unusable(es_url, tmp_path):
    """A mistake in one `[indexes.NAME]` table (a misspelt key, an unreadable es_url) stopped
    every command on every index with that one error. Now that index fails with it (exit 2,
    one line naming it), `indexes` lists it with its error, and the others serve."""
    settings = _es_index(es_url, tmp_path, {"properties": {
        "doc_key": {"type": "keyword"}, "body": {"type": "text"},
        "groups": {"type": "keyword"}}}, {"public-memo": {"body": "the public-memo budget"}},
        "groups")
    toml = tmp_path / "branchsearch.toml"
    toml.write_text(toml.read_text() + '[indexes.typo]\nlexical = "elasticsearch"\n'
                    'es_idx = "corp-docs"\n[indexes.badurl]\nlexical = "elasticsearch"\n'
                    'es_index = "x"\nes_url = "http://u:hunter2@es:99999"\n')
    assert settings.external.name == "corp"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args,
                               "--home", str(tmp_path), "--config", str(toml)],
                              capture_output=True, text=True, timeout=300)

    good = cli("retrieve", "public memo budget", "--index", "corp", "--mode", "bm25", "--json")
    assert good.returncode == 0, good.stderr
    assert "public-memo" in good.stdout
    for index, error in (("typo", "error: [indexes.typo]: unknown keys es_idx (known: "),
                         ("badurl", "error: setting [indexes.badurl] es_url: its port is not")):
        run = cli("retrieve", "budget", "--index", index)
        assert run.returncode == 2 and run.stdout == "", (index, run.stdout)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(error), (index, run.stderr)
    listed = cli("indexes", "--json")
    assert listed.returncode == 1, listed.stderr
    infos = {i["name"]: i for i in json.loads(listed.stdout)}
    assert infos["corp"]["health"] == "ok"
    assert infos["typo"]["health"].startswith("[indexes.typo]: unknown keys es_idx")
    assert "[indexes.badurl] es_url: its port" in infos["badurl"]["health"]
    assert "hunter2" not in listed.stdout + listed.stderr


def test_a_refused_milvus_address_fails_at_once(tmp_path):
    """An external Milvus at an address nobody listens on: `indexes` and `retrieve` waited out
    the client's 30 s connection timeout (37 s in all) before saying so. A TCP check answers
    first: refused is one line at once, before the embedding model loads."""
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "branchsearch.toml").write_text(
        f'[indexes.vec]\ndense = "milvus"\nmilvus_collection = "c"\n'
        f'milvus_uri = "http://root:hunter2@127.0.0.1:{port}"\n')
    for args in (["indexes", "--json"], ["retrieve", "q", "--index", "vec"]):
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", *args,
                              "--home", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)
        took = time.monotonic() - start
        said = run.stdout if args[0] == "indexes" else run.stderr
        assert run.returncode in (1, 2) and "is not answering (ConnectionRefusedError)" in said, \
            (args, run.stdout, run.stderr)
        assert "hunter2" not in run.stdout + run.stderr
        assert took < 20, (args, took)


def test_a_milvus_server_is_tcp_checked_once_per_open(tmp_path):
    """Opening an external index on a Milvus server checked that the server takes a TCP
    connection twice (before the embedding model loads, then again in the store): a second
    connection, and twice the wait on an address that drops packets. Once now, still before
    the model loads. The server here takes connections and answers nothing: the TCP checks are
    the connections that send nothing (the client's send its HTTP/2 preface)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    silent, stop = [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=watch, args=(conn,), daemon=True).start()

    def watch(conn) -> None:
        with conn:
            conn.settimeout(5)
            try:
                silent.append(conn.recv(1) == b"")
            except OSError:
                silent.append(False)

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    (tmp_path / "branchsearch.toml").write_text(
        f'backend_timeout_s = 1\n[indexes.vec]\ndense = "milvus"\nmilvus_collection = "c"\n'
        f'milvus_uri = "http://127.0.0.1:{port}"\n')
    try:
        with pytest.raises(BackendUnavailable, match="is not reachable"):
            open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                         {"home": tmp_path, "index": "vec"}, read_env=False))
        time.sleep(0.5)  # the last connection's end seen
        assert silent.count(True) == 1, silent
    finally:
        stop.set()
        listener.close()


def test_every_milvus_acl_shape_is_seen_by_the_same_callers_in_search_and_read(tmp_path):
    """The ACL rule on Milvus, a VARCHAR and an ARRAY field alike: search (the collection's
    filter) and read by id show each document to the same callers. "" in a VARCHAR field is
    how a row has no group (public); in an array, as in Elasticsearch, an empty or blank
    string is a group no caller holds."""
    from pymilvus import DataType, MilvusClient

    from branchsearch.infra.models.embedder import Embedder

    shapes = {  # doc id -> (VARCHAR value or ARRAY value, who sees it)
        "varchar-empty": ("", {"anyone"}), "varchar-blank": (" ", set()),
        "varchar-finance": ("finance", {"finance"}),
        "array-none": ([], {"anyone"}), "array-empty": ([""], set()),
        "array-finance-or-empty": (["finance", ""], {"finance"}),
        "array-blank": ([" "], set())}
    embedder = Embedder("all-MiniLM-L6-v2", 64, "cpu")
    uri = str(tmp_path / "acl.db")
    client = MilvusClient(uri=uri)
    for kind in ("varchar", "array"):
        rows = {k: v for k, (v, _) in shapes.items() if k.startswith(kind)}
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("text", DataType.VARCHAR, max_length=256)
        if kind == "varchar":
            schema.add_field("acl", DataType.VARCHAR, max_length=64)
        else:
            schema.add_field("acl", DataType.ARRAY, element_type=DataType.VARCHAR,
                             max_capacity=8, max_length=64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=embedder.dim)
        index = client.prepare_index_params()
        index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
        client.create_collection(kind, schema=schema, index_params=index)
        vectors = embedder.embed([f"the {k} budget" for k in rows])
        client.insert(kind, [{"id": k, "text": f"the {k} budget", "acl": v, "vector": x.tolist()}
                             for (k, v), x in zip(rows.items(), vectors)])
    client.close()
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)
    (tmp_path / "branchsearch.toml").write_text(
        f'milvus_uri = "{uri}"\n[indexes.varchar]\ndense = "milvus"\nmilvus_collection = '
        '"varchar"\n[indexes.array]\ndense = "milvus"\nmilvus_collection = "array"\n')
    for kind in ("varchar", "array"):
        r = open_retriever(load_settings(tmp_path / "branchsearch.toml",
                                         {"home": tmp_path, "index": kind}, read_env=False))
        try:
            _assert_shapes_seen(r, {k: v for k, v in shapes.items() if k.startswith(kind)},
                                "budget", "dense", 10)
        finally:
            r.close()


@pytest.mark.es
def test_indexes_checks_both_sides_of_a_hybrid_index(foreign, tmp_path):
    """`indexes` on a hybrid external index asked Elasticsearch only: with its Milvus refused
    (or its collection gone) it said "ok" and exited 0. Both sides are asked now; the health
    is one line naming the side that is down, and that side's address keeps no password."""
    import socket

    with socket.socket() as probe:  # a port with no server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    toml = (foreign["home"] / "branchsearch.toml").read_text()
    corp = toml[toml.index("[indexes.corp]"):toml.index("[indexes.corp_es]")]
    (tmp_path / "branchsearch.toml").write_text(
        toml[:toml.index("[indexes.")]
        + corp.replace("[indexes.corp", "[indexes.vec_down").replace(
            'dense = "milvus"\n',
            f'dense = "milvus"\nmilvus_uri = "http://root:hunter2@127.0.0.1:{port}"\n')
        + corp.replace("[indexes.corp", "[indexes.es_down").replace(
            'lexical = "elasticsearch"\n',
            f'lexical = "elasticsearch"\nes_url = "http://root:hunter2@127.0.0.1:{port}"\n')
        + corp.replace("[indexes.corp", "[indexes.both_up"))
    run = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "indexes",
                          "--json", "--home", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert "hunter2" not in run.stdout + run.stderr
    assert run.returncode == 1, (run.stdout, run.stderr)
    health = {i["name"]: i["health"] for i in json.loads(run.stdout)}
    assert health["both_up"] == "ok", health
    assert health["vec_down"] == (f"milvus side: milvus at http://***@127.0.0.1:{port} is not "
                                  "answering (ConnectionRefusedError)"), health
    assert health["es_down"].startswith("elasticsearch side: elasticsearch at "
                                        f"http://***@127.0.0.1:{port}"), health
    assert "\n" not in health["es_down"] and "milvus" not in health["es_down"], health


@pytest.mark.es
def test_indexes_loads_no_embedding_model(foreign, tmp_path, monkeypatch):
    """`indexes` checks each hybrid external index's vector dimension against the embedding
    model's, read from the model folder's configuration: three such indexes load no weights
    (counted where the model is really read; a mismatch is still refused: the 8-dim tests)."""
    from branchsearch.infra.index.catalog import list_indexes
    from branchsearch.infra.models import embedder as embedder_module

    toml = (foreign["home"] / "branchsearch.toml").read_text()
    corp = toml[toml.index("[indexes.corp]"):toml.index("[indexes.corp_es]")]
    (tmp_path / "branchsearch.toml").write_text(toml[:toml.index("[indexes.")] + "".join(
        corp.replace("[indexes.corp", f"[indexes.hybrid{i}") for i in range(3)))
    loads = []
    real = embedder_module.Embedder._load_model

    def counted(self):
        loads.append(self.model_name)
        return real(self)

    monkeypatch.setattr(embedder_module, "_MODELS", {})  # none loaded yet in this process
    monkeypatch.setattr(embedder_module.Embedder, "_load_model", counted)
    settings = load_settings(tmp_path / "branchsearch.toml", {"home": tmp_path}, read_env=False)
    infos = list_indexes(settings)
    assert [(i.name, i.health, i.documents) for i in infos] == \
        [(f"hybrid{i}", "ok", foreign["count"]) for i in range(3)]
    assert loads == []
