"""Locust users for the branchsearch HTTP service: the workload of `branchsearch loadtest --url`.

The service runs `per_key_concurrency` searches at once per key (default 4; more wait in the
key's queue, `per_key_queue`, then 429), so give each key at most that many users: more would
measure the key's queue, not the service. One key, 4 users:

    pip install 'branchsearch[loadtest]'
    BRANCHSEARCH_API_KEY=KEY BRANCHSEARCH_LOADTEST_QUERIES=data/hotpotqa-dev200 \\
      locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 1 -t 2m

More users: a file of keys, one a line (`branchsearch keys add NAME` prints one); user i sends
key i mod N, so 8 keys give 8 users one key each:

    for i in 1 2 3 4 5 6 7 8; do branchsearch keys add locust-$i; done > locust-keys.txt
    BRANCHSEARCH_LOADTEST_KEYS=locust-keys.txt BRANCHSEARCH_LOADTEST_QUERIES=data/hotpotqa-dev200 \\
      locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 1 -t 2m

Environment: BRANCHSEARCH_LOADTEST_KEYS (a file of service keys, one a line; # comments
skipped) or BRANCHSEARCH_API_KEY (one key), sent as a bearer token;
BRANCHSEARCH_LOADTEST_QUERIES (JSONL of questions or a BEIR folder; required),
BRANCHSEARCH_LOADTEST_SEED (question order, default 0), BRANCHSEARCH_LOADTEST_INDEX,
BRANCHSEARCH_LOADTEST_BRANCHES, BRANCHSEARCH_LOADTEST_DEADLINE_S (request fields, optional),
BRANCHSEARCH_LOADTEST_THINK (seconds between a user's answer and its next question, default 0).

Every user asks the next question of one seeded sequence. An answer counts as a Locust failure
when it is not HTTP 200 (named `http_<code>:<error>`) or when its result `status` is not `ok`
(`partial`, `failed`) — the same classes `branchsearch loadtest` reports. A refusal (429: the
key is over its limit; 503 `overloaded`) is a failure recorded under its own name, `/v1/search
refused`, so its fast answers stay out of `/v1/search`'s response times; a 503 that says the
service cannot search (`backend_unavailable`, `not_ready`, …: its backend is down, not busy)
under `/v1/search unavailable`, apart from both. A user the service did not take on (refused,
unavailable, or turned down) waits the `Retry-After` it sent (at most 60 s; 0.5 s without one)
before its next question, as a client honouring it would and as `loadtest --users` does: a refusal
answers in milliseconds, and a user that asked again at once would count hundreds of refusals a
second, measuring its own retries rather than the service. Locust users are a closed loop (each
waits for its answer); for open-loop arrivals use `branchsearch loadtest --rate`.
"""

from __future__ import annotations

import itertools
import os

from locust import HttpUser, task

from branchsearch.orchestrator.loadtest.generator import BACKOFF_S
from branchsearch.orchestrator.loadtest.stats import is_refusal, is_unavailable, is_unserved
from branchsearch.orchestrator.loadtest.targets import result_status, retry_after_s
from branchsearch.orchestrator.loadtest.workload import Workload, read_questions

_QUERIES = os.environ.get("BRANCHSEARCH_LOADTEST_QUERIES")
if not _QUERIES:
    raise SystemExit("locustfile: set BRANCHSEARCH_LOADTEST_QUERIES to a JSONL of questions "
                     "or a BEIR folder")
WORKLOAD = Workload(read_questions(_QUERIES), int(os.environ.get("BRANCHSEARCH_LOADTEST_SEED",
                                                                 "0")), _QUERIES)
_NEXT = itertools.count()
_USERS = itertools.count()


def _keys() -> list[str]:
    path = os.environ.get("BRANCHSEARCH_LOADTEST_KEYS")
    if path:
        try:
            # as `branchsearch loadtest --key-file` reads it: a BOM, blank lines and # comments
            # are no keys
            keys = [line.strip() for line in open(path, encoding="utf-8-sig")
                    if line.strip() and not line.strip().startswith("#")]
        except OSError as exc:
            raise SystemExit(f"locustfile: BRANCHSEARCH_LOADTEST_KEYS={path}: {exc.strerror}") \
                from None
        if not keys:
            raise SystemExit(f"locustfile: BRANCHSEARCH_LOADTEST_KEYS={path} holds no key")
        return keys
    key = os.environ.get("BRANCHSEARCH_API_KEY", "").strip()
    return [key] if key else []


KEYS = _keys()
REFUSED = "/v1/search refused"  # 429 and 503 overloaded: their own row, out of /v1/search's times
UNAVAILABLE = "/v1/search unavailable"  # 503s of a service that cannot search: no overload
_FIELDS = {"index": os.environ.get("BRANCHSEARCH_LOADTEST_INDEX"),
           "branches": os.environ.get("BRANCHSEARCH_LOADTEST_BRANCHES"),
           "deadline_s": os.environ.get("BRANCHSEARCH_LOADTEST_DEADLINE_S")}
BODY = {k: (v if k == "index" else (int(v) if k == "branches" else float(v)))
        for k, v in _FIELDS.items() if v}


THINK = float(os.environ.get("BRANCHSEARCH_LOADTEST_THINK", "0"))


class SearchUser(HttpUser):
    def wait_time(self) -> float:
        """THINK between an answer and the next question; after a request no service took on
        (refused, unavailable, rejected, unreached), the `Retry-After` its answer asked for (at
        most 60 s), or 0.5 s without one, when that is longer: as `loadtest --users` waits."""
        back_off, self.back_off = self.back_off, 0.0
        return max(THINK, back_off)

    def on_start(self) -> None:
        key = KEYS[next(_USERS) % len(KEYS)] if KEYS else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.back_off = 0.0

    @task
    def search(self) -> None:
        body = {"question": WORKLOAD.question(next(_NEXT)), **BODY}
        with self.client.post("/v1/search", json=body, headers=self.headers, name="/v1/search",
                              catch_response=True) as response:
            if response.status_code != 200:
                try:
                    error = response.json().get("error", "")
                except Exception:  # not JSON (a proxy's error page)
                    error = ""
                outcome = f"http_{response.status_code}" + (f":{error}" if error else "")
                if is_refusal(outcome):
                    response.request_meta["name"] = REFUSED
                elif is_unavailable(outcome):
                    response.request_meta["name"] = UNAVAILABLE
                if is_unserved(outcome):  # as `loadtest --users` waits (`pause_after`)
                    asked = retry_after_s(response.headers.get("Retry-After"))
                    self.back_off = BACKOFF_S if asked is None else asked
                response.failure(outcome)
                return
            try:
                status = result_status(response.json())
            except ValueError:
                response.failure("error:BadResponse")
                return
            if status != "ok":
                response.failure(status)
