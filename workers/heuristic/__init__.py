"""The heuristic policy: deterministic multi-hop search with no model, in rooms:

* `config.py`    the tuning knobs (`HeuristicConfig`, frozen, one default each)
* `state.py`     the per-episode state (`EpisodeState`) and where each chunk came from (`Origin`)
* `titles.py`    whether a title names an entity or a query; a title's qualifier and core
* `scoring.py`   a chunk's score against the query state
* `expansion.py` the searches that expand a chunk (bridge entities, residual) and recalls
* `ranker.py`    the learned final ranking, with its weights (`ranker_weights*.json`) beside it
* `policy.py`    `HeuristicPolicy`: the turn loop (observe, score, expand, prune, finish)
"""

from branchsearch.workers.heuristic.config import HeuristicConfig
from branchsearch.workers.heuristic.policy import HeuristicPolicy
from branchsearch.workers.heuristic.state import EpisodeState, Origin
from branchsearch.workers.heuristic.titles import title_qualifier

__all__ = ["EpisodeState", "HeuristicConfig", "HeuristicPolicy", "Origin", "title_qualifier"]
