"""Where the gold a branch pruned sits (issue 34's diagnostic): one branch, forks recording
with no gap bound (fork_gap 1), on a BEIR set; for every gold chunk that was pruned and is
missing from the top 10, whether it was a fork candidate, or why not (expanded, recalled, no
hop room), with its score and origin. Last line: the counts.

    python reports/forks/pruned_gold.py DATASET INDEX [HOME]
"""
import sys
from collections import Counter
from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.datasets.beir import read_queries
from branchsearch.orchestrator.driver import Driver
from branchsearch.workers.factory import make_policy
ds, index = sys.argv[1], sys.argv[2]
home = sys.argv[3] if len(sys.argv) > 3 else "/tmp/bs-home"
settings = load_settings(None, {"home": home, "index": index, "branches": 1, "forks": 1, "fork_gap": 1.0})
pol = {}
def factory(i, sq):
    pol[i] = make_policy(settings, kind="original"); return pol[i]
drv = Driver(settings, mode="local", policy_factory=factory)
doc=lambda cid: cid.rsplit('#p',1)[0]
c=Counter()
for q in read_queries(ds):
    pol.clear()
    res = drv.search(q.text, max_branches=1)
    s = pol[0].state
    top10 = list(dict.fromkeys(doc(x) for x in res.ranked_chunk_ids))[:10]
    pruned_all = set(res.branches[0].pruned_ids)
    for cid in pruned_all:
        g = doc(cid)
        if g in q.gold and g not in top10:
            why = ("expanded" if cid in s.expanded else "recalled" if cid in s.recalled else
                   "no_hop_room" if s.depth.get(cid,0) >= pol[0].config.max_hops-1 else
                   "candidate" if cid in s.fork_candidates else "forced/other")
            c[why]+=1
            print(q.id, cid, why, "depth", s.depth.get(cid,0), "score", round(s.scores.get(cid,0),3), "origin", s.origins[cid].kind)
print(c)
drv.close()
