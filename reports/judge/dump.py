"""Dump each question's fused evidence (documents in fused order, best chunk text) at a final_k."""
import argparse, json
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.driver import open_driver

p = argparse.ArgumentParser()
p.add_argument("data"); p.add_argument("index"); p.add_argument("final_k", type=int); p.add_argument("out")
p.add_argument("branches", type=int, nargs="?")
p.add_argument("--home", default="/tmp/bs-home")
a = p.parse_args()
s = load_settings(overrides={"home": a.home, "index": a.index, "final_k": a.final_k})
qids = {l.split("\t")[0] for l in open(f"{a.data}/qrels/test.tsv").read().splitlines()[1:]}
qs = [json.loads(l) for l in open(f"{a.data}/queries.jsonl")]
qs = [q for q in qs if q["_id"] in qids]
d = open_driver(s, "local")
with open(a.out, "w") as f:
    for q in qs:
        r = d.search(q["text"], max_branches=a.branches)
        ev = [{"doc_id": e["doc_id"], "title": e.get("title", ""),
               "text": (e.get("chunks") or [{}])[0].get("text", "")} for e in r.evidence]
        f.write(json.dumps({"id": q["_id"], "question": q["text"], "docs": ev}) + "\n")
d.close()
