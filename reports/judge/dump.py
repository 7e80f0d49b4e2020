"""Dump each question's fused evidence (documents in fused order, best chunk text) at a final_k."""
import json, sys
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.driver import open_driver

data, index, final_k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
branches = int(sys.argv[5]) if len(sys.argv) > 5 else None
s = load_settings(overrides={"home": "/tmp/bs-home", "index": index, "final_k": final_k})
qids = {l.split("\t")[0] for l in open(f"{data}/qrels/test.tsv").read().splitlines()[1:]}
qs = [json.loads(l) for l in open(f"{data}/queries.jsonl")]
qs = [q for q in qs if q["_id"] in qids]
d = open_driver(s, "local")
with open(out, "w") as f:
    for q in qs:
        r = d.search(q["text"], max_branches=branches)
        ev = [{"doc_id": e["doc_id"], "title": e.get("title", ""),
               "text": (e.get("chunks") or [{}])[0].get("text", "")} for e in r.evidence]
        f.write(json.dumps({"id": q["_id"], "question": q["text"], "docs": ev}) + "\n")
d.close()
