"""Prometheus metrics of the service (`branchsearch_` names, units in names).

One registry per app instance (so tests and replicas do not share module state). Labels are
bounded sets — route templates, status codes, branch statuses — never questions, keys' groups or
document ids, so `/metrics` cannot leak what a caller searched or found. Under Serve each ingress
replica counts its own requests and shares them (`snapshot`, a few seconds old at most) on the
application's board (`service.deploy`), so whichever replica the proxy sends a scrape to
answers for all of them (`render(others)`): counters and histograms summed, in-flight requests
summed, values every replica reads from one place (the ACL guard's count) taken once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("branchsearch_http_requests_total", "HTTP requests",
                                ["endpoint", "method", "status"], registry=r)
        self.latency = Histogram("branchsearch_http_request_duration_seconds",
                                 "HTTP request latency (a stream: until its last event)",
                                 ["endpoint", "method", "status"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.in_flight = Gauge("branchsearch_http_requests_in_flight",
                               "requests being served (queue depth at this replica)", registry=r)
        self.branches = Counter("branchsearch_branches_total", "branches by final status",
                                ["status"], registry=r)
        self.pruned_chunks = Counter("branchsearch_pruned_chunks_total",
                                     "chunks pruned by branches' context editing", registry=r)
        self.tokens_read = Counter("branchsearch_tokens_read_total",
                                   "tokens read by branches that finished", registry=r)
        self.searches = Counter("branchsearch_searches_total", "searches by result status",
                                ["status"], registry=r)
        self.search_latency = Histogram("branchsearch_search_duration_seconds",
                                        "driver latency of searches that answered",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.backend_errors = Counter("branchsearch_backend_errors_total",
                                      "requests refused because a backend was unavailable",
                                      registry=r)
        self.refusals = Counter("branchsearch_refusals_total", "requests refused by a limit",
                                ["reason"], registry=r)
        self.acl_guard_dropped = Gauge("branchsearch_acl_guard_dropped_ids",
                                       "ids the service's ACL guard removed (0 unless documents' groups change during searches)",
                                       registry=r)
        self.searches_past_deadline = Gauge(
            "branchsearch_searches_past_deadline",
            "searches past their deadline (answered 504) whose thread still waits on a "
            "backend; each holds a place of max_in_flight until it ends", registry=r)

    def observe_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        labels = (endpoint, method, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)

    def observe_error(self, status: int, error: str) -> None:
        if error in ("backend_unavailable", "not_ready", "search_failed"):
            self.backend_errors.inc()
        if status in (413, 422, 429, 503, 504):
            self.refusals.labels(error).inc()

    def observe_result(self, result: dict) -> None:
        self.searches.labels(result.get("status", "unknown")).inc()
        for b in result.get("branches", []):
            self.branches.labels(b.get("status", "unknown")).inc()
            self.pruned_chunks.inc(len(b.get("pruned_ids", [])))
        self.tokens_read.inc(result.get("metrics", {}).get("tokens_read", 0) or 0)
        if "latency_s" in result.get("metrics", {}):
            self.search_latency.observe(result["metrics"]["latency_s"])

    def snapshot(self) -> list:
        """This replica's samples, plain data: [(family, type, help, [(sample, labels, value)])]."""
        return [(m.name, m.type, m.documentation, [(x.name, dict(x.labels), x.value)
                                                   for x in m.samples])
                for m in self.registry.collect()]

    def render(self, others: list | None = None) -> bytes:
        """The Prometheus text of this replica, with `others` (the other replicas'
        snapshots) merged in."""
        if not others:
            return generate_latest(self.registry)
        return generate_latest(_Merged([self.snapshot(), *others]))


# every replica reads the same value, the searcher's (`SearcherClient.gauges`), when it is
# scraped: the scraped replica's own reading is the current one (another's is as old as its
# last scrape, and these gauges go down too)
SHARED_GAUGES = {"branchsearch_acl_guard_dropped_ids", "branchsearch_searches_past_deadline"}


class _Merged:
    """A collector of several replicas' snapshots: a sample's values summed across replicas,
    but `_created` timestamps (the earliest) and shared gauges (the first snapshot's: the
    scraped replica's own, read now)."""

    def __init__(self, snapshots: list):
        self.snapshots = snapshots

    def collect(self):
        from prometheus_client.core import Metric

        families: dict[str, tuple] = {}
        for snapshot in self.snapshots:
            for name, kind, doc, samples in snapshot:
                _, _, values = families.setdefault(name, (kind, doc, {}))
                for sample, labels, value in samples:
                    key = (sample, tuple(sorted(labels.items())))
                    if key not in values:
                        values[key] = value
                    elif sample.endswith("_created"):
                        values[key] = min(values[key], value)
                    elif name in SHARED_GAUGES:
                        pass
                    else:
                        values[key] += value
        for name, (kind, doc, values) in families.items():
            family = Metric(name, doc, kind)
            for (sample, labels), value in values.items():
                family.add_sample(sample, dict(labels), value)
            yield family
