"""Load testing: the arrival process, the statistics by hand, knee and SLO on synthetic curves,
the generator's open-loop timing (no coordinated omission), and short real runs against the
in-process driver, the live service (`branchsearch serve`'s app under uvicorn) and Locust against
it. Every request goes to loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.loadtest import arrivals
from branchsearch.orchestrator.loadtest.generator import Generator, LoadSpec
from branchsearch.orchestrator.loadtest.stats import (DROPPED, UNFINISHED, Sample, find_knee,
                                                      slo_broken_at, slo_max, summarize)
from branchsearch.orchestrator.loadtest import targets
from branchsearch.orchestrator.loadtest.targets import (HttpTarget, RequestFailed, classify,
                                                        most_at_once, stage_times)
from branchsearch.orchestrator.loadtest.workload import Workload, read_questions
from branchsearch.orchestrator.evaluation.measures import percentile

ROOT = Path(__file__).resolve().parents[2]


# --- arrivals -----------------------------------------------------------------------------------

def test_poisson_rate_and_gaps_within_tolerance():
    times = arrivals.poisson_schedule(20.0, 200.0, random.Random(3))
    # 4000 expected; sd of a Poisson count is sqrt(4000) ~ 63: allow 4 sd
    assert abs(len(times) - 4000) < 4 * 63
    gaps = np.diff([0.0, *times])
    assert abs(gaps.mean() - 0.05) < 0.003
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.06  # exponential: coefficient of variation 1
    assert times == sorted(times) and 0 < times[0] and times[-1] < 200
    assert arrivals.poisson_schedule(20.0, 200.0, random.Random(3)) == times  # seeded


def test_constant_schedule_is_evenly_spaced():
    times = arrivals.constant_schedule(4.0, 2.0)
    assert times == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert arrivals.schedule("constant", 3.0, 1.0) == pytest.approx([0, 1 / 3, 2 / 3])
    with pytest.raises(BranchsearchError, match="poisson or constant"):
        arrivals.schedule("bursty", 1.0, 1.0)


def test_ramp_parsing_and_bounded_plan():
    assert arrivals.parse_ramp("1:4:1") == [1, 2, 3, 4]
    assert arrivals.parse_ramp("0.5:2:0.5") == [0.5, 1.0, 1.5, 2.0]
    assert arrivals.parse_ramp("1:2.5:1") == [1, 2]
    for bad in ("1:4", "a:b:c", "4:1:1", "0:4:1", "1:4:0"):
        with pytest.raises(BranchsearchError, match="--ramp"):
            arrivals.parse_ramp(bad)
    steps, cut = arrivals.plan_steps([1, 2, 3, 4], 10, total_s=25, drain_s=2)
    assert [s.load for s in steps] == [1, 2] and cut == 2  # 2 x (10 + 2) <= 25 < 3 x 12


# --- statistics ---------------------------------------------------------------------------------

def test_percentiles_match_numpy():
    rng = np.random.default_rng(5)
    values = list(rng.lognormal(0, 1, 997))
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_by_hand_counts_latency_from_the_scheduled_time():
    # five requests scheduled at 0, 1, 2, 3, 4 s of a 5 s step; the third was sent 1.5 s late
    # (the generator was busy) and its latency must include that wait
    s = [Sample(0, 100.0, 100.0, 100.2, "ok", {"plan": 0.01}, tokens_read=100),
         Sample(0, 101.0, 101.0, 101.4, "ok", {"plan": 0.03}, tokens_read=100),
         Sample(0, 102.0, 103.5, 103.6, "ok", {"plan": 0.02}, tokens_read=100),
         Sample(0, 103.0, 103.0, 103.3, "partial", {}, branch_status={"branch_timeout": 1}),
         Sample(0, 104.0, 0.0, None, DROPPED)]
    out = summarize(s, load=1.0, loop="open", duration_s=5.0, cutoff=110.0)
    # latencies of the answered: 0.2, 0.4, 1.6, 0.3 s (dropped: no latency)
    lat = [0.2, 0.4, 1.6, 0.3]
    assert out["latency_ms"]["p50"] == pytest.approx(np.percentile(lat, 50) * 1000)
    assert out["latency_ms"]["p99"] == pytest.approx(np.percentile(lat, 99) * 1000)
    assert out["latency_ms"]["max"] == pytest.approx(1600)
    assert out["offered_rate"] == 1.0 and out["sent"] == 5 and out["ok"] == 3
    # completions at 100.2, 101.4, 103.3, 103.6: a span of 3.4 s, 0.4 s more than their
    # sends' (100 to 103), which stretches the 5 s step to 5.4 s; 3 of the 4 answers ok
    assert out["throughput_rate"] == pytest.approx(4 / 5.4, abs=1e-4)
    assert out["achieved_rate"] == pytest.approx(3 / 5.4, abs=1e-4)
    assert out["errors"] == {"dropped": 1, "partial": 1} and out["error_rate"] == 0.4
    assert out["branch_errors"] == {"branch_timeout": 1}
    assert out["send_lag_ms"]["max"] == pytest.approx(1500)
    assert out["stages_ms"]["plan"]["p50"] == pytest.approx(20)
    assert out["tokens_read_per_s"] == pytest.approx(300 / 3.6, abs=0.1)
    assert not out["latency_lower_bound"]


def test_refusals_stay_out_of_the_latency_percentiles_and_are_counted_apart():
    # two searches of 2 and 3 s; three fast refusals (a key over its limit, an overloaded
    # service): they are errors, but the percentiles describe the searches the service ran
    s = [Sample(0, 0.0, 0.0, 2.0, "ok"), Sample(0, 0.1, 0.1, 3.1, "ok"),
         Sample(0, 0.2, 0.2, 0.21, "http_429:too_many_requests"),
         Sample(0, 0.3, 0.3, 0.32, "http_429:too_many_requests"),
         Sample(0, 0.4, 0.4, 0.43, "http_503:overloaded"),
         Sample(0, 0.5, 0.5, 5.5, "http_504:deadline_exceeded")]
    out = summarize(s, load=6, loop="closed", duration_s=6.0, cutoff=9.0)
    lat = [2.0, 3.0, 5.0]  # the two answers and the 504 (it ran to its deadline)
    assert out["latency_ms"]["p50"] == pytest.approx(np.percentile(lat, 50) * 1000)
    assert out["latency_ms"]["max"] == pytest.approx(5000)
    assert out["refused"] == 3 and out["refusal_rate"] == 0.5
    assert out["refusals"] == {"http_429:too_many_requests": 2, "http_503:overloaded": 1}
    assert out["refusal_latency_ms"]["max"] == pytest.approx(30)
    assert out["error_rate"] == pytest.approx(4 / 6, abs=1e-4)  # refusals are still errors
    # the report's table: refusals in their own column, not among the other errors
    from branchsearch.orchestrator.loadtest import report as rep

    report = {"command": "c", "started": "s", "machine": {"cpus": 2, "platform": "p",
                                                          "load_average": "0"},
              "target": {"kind": "service"}, "workload": {"source": "w", "questions": 1,
                                                          "seed": 0},
              "arrivals": {"loop": "closed", "process": "poisson", "step_duration_s": 6,
                           "drain_s": 5, "max_inflight": 256, "think_s": 0},
              "steps": [out], "knee": find_knee([out]), "stopped": ""}
    row = [line for line in rep.markdown(report).splitlines() if line.startswith("| 6 ")][0]
    assert "| 3 (50.0%): http_429:too_many_requests 2, http_503:overloaded 1; answered in " \
           "p99 30 / max 30 ms | http_504:deadline_exceeded 1 |" in row  # how long they took:
    # a 503 after a long hold is an outage, not a quick "retry later"
    assert "| 6 | 3000 | 4600 | " in row  # sent 6; p50 and p90 of the three that ran


def test_step_line_names_errors_by_class_not_as_a_python_dict():
    # the line a finished step prints on stderr: the error classes read as the report's table
    # writes them, with no dict braces or quotes
    from branchsearch.orchestrator.loadtest.generator import step_line

    s = [Sample(0, 0.0, 0.0, 2.0, "ok"),
         Sample(0, 0.2, 0.2, 0.21, "http_429:too_many_requests"),
         Sample(0, 0.3, 0.3, 0.32, "http_429:too_many_requests"),
         Sample(0, 0.5, 0.5, 5.5, "http_504:deadline_exceeded")]
    out = summarize(s, load=4, loop="closed", duration_s=6.0, cutoff=9.0)
    out["step"] = 0
    line = step_line(out)
    assert "errors 75.0% http_429:too_many_requests 2, http_504:deadline_exceeded 1, " \
           "refused 2" in line, line
    assert not re.search(r"[{}']", line), line


def test_unfinished_requests_enter_latency_at_their_lower_bound():
    s = [Sample(0, 0.0, 0.0, 0.1, "ok"), Sample(0, 1.0, 1.0, None, UNFINISHED)]
    out = summarize(s, load=1, loop="open", duration_s=2.0, cutoff=9.0)
    assert out["latency_ms"]["max"] == pytest.approx(8000) and out["latency_lower_bound"]
    assert out["errors"] == {"unfinished": 1}
    # still busy at the cutoff: one answer in the 9 s from the first send to the cutoff
    assert out["achieved_rate"] == pytest.approx(1 / 9, abs=1e-4)


def test_achieved_never_exceeds_what_was_offered():
    """Ten requests at 5/s that all kept up, the first answered slowest: the span of their
    completions is shorter than the sends', and the achieved rate read 9.52/s of 5/s offered
    (in a real run, 1.03/s of 0.85/s). Answers a second cannot outnumber requests a second."""
    s = [Sample(0, i * 0.2, i * 0.2, i * 0.2 + (1.0 if i == 0 else 0.05), "ok")
         for i in range(10)]
    out = summarize(s, load=5, loop="open", duration_s=2.0, cutoff=3.0)
    assert out["offered_rate"] == 5 and out["achieved_rate"] == pytest.approx(5)
    # a target that falls behind still shows it: the same sends, answered 0.5 s apart
    s = [Sample(0, i * 0.2, i * 0.2, 0.1 + i * 0.5, "ok") for i in range(10)]
    slow = summarize(s, load=5, loop="open", duration_s=2.0, cutoff=6.0)
    assert slow["achieved_rate"] < 0.5 * slow["offered_rate"]


def test_one_slow_request_is_no_knee_and_queueing_still_is():
    """Two steps of a service that kept up (a ramp against `serve` on Ray Serve, 2 shared
    cores): the median stayed at 114 -> 139 ms while one request of the second took 987 ms, so
    its p99 (with ten requests, about their slowest) was 4.9 x the first step's, and the knee
    read 'p99 987 ms > 3 x the first step's 200 ms' on that one request. Queueing moves every
    request, the median with them: that is still a knee."""
    def step(slow_ms, shift_s=0.0):  # ten requests 0.8 s apart, answered in 100-130 ms
        s = [Sample(0, i * 0.8, i * 0.8, i * 0.8 + 0.1 + 0.003 * i + shift_s, "ok")
             for i in range(10)]
        s[5].done = s[5].scheduled + slow_ms / 1000
        return summarize(s, load=1.25, loop="open", duration_s=8.0, cutoff=20.0)

    first, jitter = step(200), step(987)
    assert jitter["latency_ms"]["p99"] > 3 * first["latency_ms"]["p99"]
    assert jitter["achieved_rate"] == pytest.approx(1.25, rel=0.02)
    assert find_knee([first, jitter]) == {"knee": None, "saturated_at": None,
                                          "reason": "not reached up to 1.25: raise the ramp's "
                                                    "STOP"}
    queued = step(1400, shift_s=0.3)  # every request 0.3 s later: the median 3.5 x
    assert find_knee([first, queued])["knee"] == 1.25
    assert "p50" in find_knee([first, queued])["reason"]


def test_a_step_that_sent_nothing_draws_no_knee():
    """A step with no request (a ^C before the first send) 'held' every load: the knee read
    'not reached up to 2'. It measured nothing, and says so."""
    empty = summarize([], load=2, loop="closed", duration_s=1.0, cutoff=1.0)
    knee = find_knee([empty])
    assert knee["knee"] is None and knee["saturated_at"] is None
    assert knee["reason"] == "step 1 sent no request: it measured nothing; no knee drawn"


def _step(load, achieved, p99, errors=0.0, loop="open", throughput=None):
    return {"load": load, "loop": loop, "sent": 10,
            "offered_rate": load if loop == "open" else None,
            "users": load if loop == "closed" else None, "achieved_rate": achieved,
            "throughput_rate": throughput if throughput is not None else achieved,
            "error_rate": errors, "latency_ms": {"p50": p99 / 2, "p99": p99}}


def test_knee_where_throughput_stops_following_the_offered_rate():
    curve = [_step(1, 1.0, 300), _step(2, 1.98, 320), _step(3, 2.9, 400), _step(4, 3.1, 600),
             _step(5, 3.1, 5000)]
    knee = find_knee(curve)
    assert knee["knee"] == 3 and knee["saturated_at"] == 4 and "achieved" in knee["reason"]


def test_knee_where_latency_blows_up_or_errors_appear():
    latency = [_step(1, 1, 200), _step(2, 2, 250), _step(3, 3, 700)]
    assert find_knee(latency)["knee"] == 2 and "p50" in find_knee(latency)["reason"]
    errors = [_step(1, 1, 200), _step(2, 2, 210, errors=0.05)]
    assert find_knee(errors)["knee"] == 1 and "errors" in find_knee(errors)["reason"]
    healthy = [_step(1, 1, 200), _step(2, 2, 210)]
    assert find_knee(healthy)["knee"] is None and "not reached" in find_knee(healthy)["reason"]
    first = [_step(4, 1.0, 200)]
    assert find_knee(first)["knee"] is None and "first step" in find_knee(first)["reason"]


def test_closed_loop_knee_is_where_throughput_stops_scaling_with_users():
    curve = [_step(1, 1.0, 500, loop="closed"), _step(2, 1.9, 520, loop="closed"),
             _step(4, 3.6, 600, loop="closed"), _step(8, 4.0, 1900, loop="closed")]
    assert find_knee(curve)["knee"] == 4 and find_knee(curve)["saturated_at"] == 8


def test_slo_holds_up_to_the_last_step_of_an_unbroken_run():
    curve = [_step(1, 1, 300), _step(2, 2, 450), _step(3, 3, 900), _step(4, 4, 480)]
    assert slo_max(curve, 500)["load"] == 2  # step 4 is under the SLO but step 3 broke it
    assert slo_max(curve, 1000)["load"] == 4
    assert slo_max(curve, 100) is None
    assert slo_max([_step(1, 1, 300, errors=0.02)], 500) is None  # errors > 1 %
    assert slo_max([_step(1, 0.5, 300)], 500) is None  # did not keep up with the offered rate


def test_the_slo_line_says_at_which_step_and_why_it_broke():
    """A step within the p99 and error limits can still break the SLO by its third criterion,
    achieved ≥ 90 % of offered: the line names every criterion, and the JSON and the line the
    step that broke it and why."""
    curve = [_step(7, 6.65, 954), _step(8, 8.13, 1866)]
    curve[1]["offered_rate"] = 9.17
    assert slo_max(curve, 8000)["load"] == 7
    assert slo_broken_at(curve, 8000) == {"load": 8, "reason": "achieved 8.13/s < 90% of "
                                                               "offered 9.17/s"}
    assert slo_broken_at(curve, 1000) == {"load": 8, "reason": "p99 1866 ms > 1000 ms"}
    assert slo_broken_at(curve[:1], 8000) is None


# --- targets ------------------------------------------------------------------------------------

def test_classify_derives_status_and_stages_from_the_result():
    result = {"branches": [{"status": "ok", "latency_s": 0.5, "backend_s": 0.1, "policy_s": 0.2},
                           {"status": "timeout", "latency_s": 2.0}],
              "metrics": {"latency_s": 2.1, "branch_latency_s_max": 2.0, "tokens_read": 77,
                          "plan_s": 0.05, "fusion_s": 0.001, "engine_wait_s": 0.3}}
    out = classify(result)
    assert out["outcome"] == "partial" and out["tokens_read"] == 77
    assert out["branch_status"] == {"branch_timeout": 1}
    assert out["stages"] == {"server": 2.1, "slowest_branch": 2.0, "backend": 0.1, "policy": 0.2,
                             "plan": 0.05, "fusion": 0.001, "engine_wait": 0.3}
    assert classify({**result, "status": "failed"})["outcome"] == "failed"  # reported wins
    assert stage_times({"branches": [{"status": "ok", "latency_s": 0.4}]}) == \
        {"slowest_branch": 0.4}
    assert stage_times({"metrics": {"latency_s": 0.5, "branch_latency_s_max": 0.4}}) == \
        pytest.approx({"server": 0.5, "slowest_branch": 0.4, "outside_branches": 0.1})
    # branches one after another (sum 0.9 s within the 1.0 s total): 0.1 s outside them
    sequential = {"latency_s": 1.0, "branch_latency_s_max": 0.5, "branch_latency_s_sum": 0.9}
    assert stage_times({"metrics": sequential})["outside_branches"] == pytest.approx(0.1)


def test_a_workload_is_utf8_text_of_questions_the_service_would_search(tmp_path):
    """A Latin-1 questions file was a traceback (UnicodeDecodeError); a question the driver and
    the service refuse (a NUL, only punctuation, a lone surrogate) was sent, answered 422 in
    milliseconds, and read as saturation (a knee 'errors 14.8 %'). Each is now one line naming
    the file and the line, before any load; a UTF-8 BOM (Windows editors) is no part of it."""
    f = tmp_path / "q.jsonl"
    f.write_bytes('{"question": "Who built the lighthouse?"}\n{"question": "caf\u00e9 au '
                  'lait"}\n'.encode("latin-1"))
    with pytest.raises(BranchsearchError, match=r"q.jsonl:2: not UTF-8 text"):
        read_questions(f)
    for line, why in (('{"question": "x\\u0000y"}', "control character U+0000"),
                      ('{"question": "?!"}', "no words to search for"),
                      ('{"question": "\\ud800 a"}', "lone surrogate"),
                      ('{"question": ""}', "empty question")):
        f.write_text('{"question": "Who built the lighthouse?"}\n' + line + "\n")
        with pytest.raises(BranchsearchError, match=r"q.jsonl:2: .*" + re.escape(why)):
            read_questions(f)
    f.write_bytes(b'\xef\xbb\xbf{"question": "Z\xc3\xbcrich harbor?"}\n')
    assert read_questions(f) == ["Zürich harbor?"]


def test_workload_reads_beir_and_plain_jsonl_and_is_seeded(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question": "a?"}\n\n{"_id": "2", "text": "b?"}\n{"query": "c?"}\n')
    assert read_questions(f) == ["a?", "b?", "c?"]
    w1, w2 = Workload(["a", "b", "c", "d"], seed=1), Workload(["a", "b", "c", "d"], seed=1)
    assert [w1.question(i) for i in range(8)] == [w2.question(i) for i in range(8)]
    assert sorted(w1.question(i) for i in range(4)) == ["a", "b", "c", "d"]
    f.write_text('{"question": "a?"}\n{"id": 3}\n')
    with pytest.raises(BranchsearchError, match=r"q.jsonl:2"):
        read_questions(f)


def test_a_workload_line_naming_a_key_twice_is_refused_with_its_line(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question": "a?"}\n{"question": "b?", "question": "c?"}\n')
    with pytest.raises(BranchsearchError, match=r"q.jsonl:2: the key 'question' is given twice"):
        read_questions(f)


def test_synth_workload_writes_its_corpus_once_and_asks_its_questions(tmp_path):
    from branchsearch.orchestrator.loadtest.workload import from_synth

    w = from_synth(tmp_path / "s", 3, seed=1)
    assert len(w.questions) == 3 and all("plan for Project" in q for q in w.questions)
    corpus = (tmp_path / "s" / "corpus.jsonl").read_text()
    assert len(corpus.splitlines()) == 24 and w.corpus == tmp_path / "s"
    assert from_synth(tmp_path / "s", 3, seed=1).questions == w.questions


def test_probe_arithmetic_engine_rates_and_service_counters():
    from branchsearch.orchestrator.loadtest.probes import (engine_rates, metric_deltas,
                                                           parse_prometheus, summarize_gpu)

    before = {"e0": {"requests": 10, "completion_tokens": 1000, "seconds": 5.0, "batches": 10}}
    after = {"e0": {"requests": 40, "completion_tokens": 4000, "seconds": 15.0, "batches": 20}}
    assert engine_rates(before, after, 20.0) == {"e0": {
        "requests": 30, "completion_tokens": 3000, "completion_tokens_per_s": 150.0,
        "busy_share": 0.5, "mean_batch": 3.0}}
    text = ("# HELP x\nbranchsearch_searches_total{status=\"ok\"} 12\n"
            "branchsearch_http_requests_in_flight 3\nbranchsearch_search_duration_seconds_bucket"
            "{le=\"1\"} 4\nvllm:num_requests_running 2\nother_metric 9\nbroken line\n")
    parsed = parse_prometheus(text)
    assert parsed["branchsearch_searches_total{status=\"ok\"}"] == 12 and len(parsed) == 5
    deltas = metric_deltas({"branchsearch_searches_total{status=\"ok\"}": 2.0}, parsed, 5.0)
    assert deltas == {"branchsearch_http_requests_in_flight": 3.0,
                      "branchsearch_searches_total{status=\"ok\"} /s": 2.0,
                      "vllm:num_requests_running": 2.0}
    gpu = summarize_gpu([[{"index": 0, "name": "H200", "util_pct": 40.0, "mem_used_mib": 1000,
                           "mem_total_mib": 143000}],
                         [{"index": 0, "name": "H200", "util_pct": 80.0, "mem_used_mib": 3000,
                           "mem_total_mib": 143000}]])
    assert gpu == {"0": {"name": "H200", "util_pct_mean": 60.0, "util_pct_max": 80.0,
                         "mem_used_mib_max": 3000, "mem_total_mib": 143000}}


# --- the generator, against targets with known timing ------------------------------------------

class SleepTarget:
    """Answers after `seconds`; with `capacity`, at most that many at once (a queue)."""

    def __init__(self, seconds: float, capacity: int | None = None):
        self.seconds = seconds
        self.slots = threading.Semaphore(capacity) if capacity else None

    def search(self, question: str) -> dict:
        if self.slots:
            with self.slots:
                time.sleep(self.seconds)
        else:
            time.sleep(self.seconds)
        return {"branches": [{"status": "ok", "latency_s": self.seconds}],
                "metrics": {"latency_s": self.seconds, "tokens_read": 10}}

    def describe(self) -> dict:
        return {"kind": "sleep"}

    def close(self) -> None:
        pass


def _run(target, loop="open", loads=(5.0,), duration=2.0, **kw):
    spec = LoadSpec(loop, tuple(arrivals.Step(x, duration) for x in loads), warmup=0, **kw)
    started = time.monotonic()
    out = Generator(target, Workload(["q1", "q2"]), spec).run()
    return out, time.monotonic() - started


def test_slow_answers_do_not_delay_open_loop_arrivals():
    # 0.6 s answers at 10/s: a closed loop of one user could send under 2/s; the open loop must
    # send on schedule (all 20) with ~10 in flight
    out, wall = _run(SleepTarget(0.6), loads=(10.0,), process="constant", duration=2.0)
    s = out["steps"][0]
    assert s["sent"] == 20 and s["ok"] == 20
    assert s["send_lag_ms"]["p99"] < 250  # coordinated omission would lag by seconds
    assert 550 < s["latency_ms"]["p50"] < 900
    assert s["achieved_rate"] == pytest.approx(10, rel=0.15)
    assert wall < 2.0 + 0.6 + 1.0


def test_queueing_shows_in_latency_measured_from_the_schedule():
    # capacity 1 x 0.2 s = 5/s served; 10/s offered: each request waits behind the earlier ones,
    # so latency grows through the step (a closed loop would report ~0.2 s throughout)
    out, _ = _run(SleepTarget(0.2, capacity=1), loads=(10.0,), process="constant",
                  duration=1.5, drain_s=5.0)
    s = out["steps"][0]
    assert s["ok"] == 15 and s["latency_ms"]["max"] > 1300  # the 15th waited for 14 others
    assert s["achieved_rate"] == pytest.approx(5, rel=0.15)
    assert find_knee(out["steps"])["knee"] is None  # one saturated step: no knee below it
    closed, _ = _run(SleepTarget(0.2, capacity=1), loop="closed", loads=(1,), duration=1.0)
    assert closed["steps"][0]["latency_ms"]["p99"] < 300


def test_a_step_cut_by_ctrl_c_is_measured_up_to_the_ctrl_c():
    """^C against a service: the step's /metrics probe still waited its 3 s for the replicas'
    counts before the partial step was summed, and those 3 s entered its time: 10/s offered
    for 1.5 s was reported as 'offered 3.3/s, achieved 3.3/s'. The cut step is measured up
    to the ^C, and the ^C stops the run at once."""
    import signal

    from branchsearch.orchestrator.loadtest.probes import StepProbe

    spec = LoadSpec("open", (arrivals.Step(10.0, 30.0),), warmup=0, process="constant")
    generator = Generator(SleepTarget(0.05), Workload(["q1", "q2"]), spec,
                          probe=lambda: StepProbe(None, lambda: ""))
    # ^C as a terminal's raises KeyboardInterrupt, whatever handler earlier in-process work left
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        out = generator.run()
        wall = time.monotonic() - started
    finally:
        signal.signal(signal.SIGINT, was)
    step = out["steps"][0]
    assert out["interrupted"] and step["partial"], (wall, was)
    assert wall < 2.5 and step["wall_s"] < 2.0, (wall, step["wall_s"])
    assert step["offered_rate"] == pytest.approx(10, rel=0.25)
    assert out["knee"]["reason"] == "not reached up to 10: interrupted before the last step"


@pytest.mark.parametrize("options, says", [
    ({"rate": 2.0, "duration_s": 2.0}, "not reached up to 2: one load measured; --ramp "
                                       "START:STOP:STEP looks for the knee"),
    ({"ramp": "2:6:2", "step_duration_s": 1.0, "duration_s": 1.5, "drain_s": 0.2},
     "not reached up to 2: --duration 1.5 s ran 1 of the ramp's 3 steps: lengthen it"),
    ({"ramp": "2:4:2", "step_duration_s": 1.0}, "not reached up to 4: raise the ramp's STOP")])
def test_a_knee_not_reached_says_what_to_change(options, says):
    """'Knee: none (not reached up to 2: raise the ramp's STOP)' after a --rate run, which has
    no ramp, and after a ramp that --duration cut short; each now names what to change."""
    from branchsearch.orchestrator.loadtest.run import Options, load_spec

    spec, _ = load_spec(Options(arrivals="constant", warmup=0, **options))
    assert Generator(SleepTarget(0.01), Workload(["q1"]), spec).run()["knee"]["reason"] == says


def test_in_flight_cap_drops_and_drain_bounds_the_step():
    out, wall = _run(SleepTarget(5.0), loads=(10.0,), process="constant", duration=0.5,
                     max_inflight=2, drain_s=0.3)
    s = out["steps"][0]
    assert s["errors"] == {"dropped": 3, "unfinished": 2} and s["ok"] == 0
    assert s["latency_lower_bound"]
    assert wall < 0.5 + 0.3 + 0.5  # did not wait for the 5 s answers


def test_closed_loop_users_and_a_ramp_stopping_after_the_knee():
    out, wall = _run(SleepTarget(0.1, capacity=2), loop="closed", loads=(1, 2, 4, 8),
                     duration=1.0)
    tput = [s["throughput_rate"] for s in out["steps"]]
    assert tput[0] == pytest.approx(10, rel=0.2) and tput[1] == pytest.approx(20, rel=0.2)
    assert out["knee"]["knee"] == 2 and out["knee"]["saturated_at"] == 4
    assert len(out["steps"]) == 3 and "stopped after step 3" in out["stopped"]
    assert wall < 4 * 1.0


# --- real runs: the in-process driver, a live loopback service, Locust -------------------------

@pytest.fixture(scope="module")
def local_driver(hotpot_settings):
    from branchsearch.orchestrator.driver import Driver

    driver = Driver(hotpot_settings.replace(branches=2), mode="local")
    yield driver
    driver.close()


def test_short_real_run_against_the_in_process_driver_stops_on_time(local_driver, tmp_path):
    from branchsearch.orchestrator.loadtest import report as rep
    from branchsearch.orchestrator.loadtest.targets import DriverTarget

    from conftest import HOTPOT

    # 1/s for 3 s: three requests; the drain is generous (a shared 2-core machine is slow) but
    # bounded, and whatever it cuts off must show as unfinished, not vanish
    spec = LoadSpec("open", (arrivals.Step(1.0, 3.0),), process="constant", drain_s=20.0,
                    warmup=1)
    started = time.monotonic()
    out = Generator(DriverTarget(local_driver), Workload(read_questions(HOTPOT)), spec).run()
    step_wall = out["steps"][0]["wall_s"]
    assert step_wall < 3 + 20 + 1  # the step, its drain, slack
    assert time.monotonic() - started < step_wall + 60  # and the warm-up request
    s = out["steps"][0]
    assert s["sent"] == 3 and s["ok"] >= 1
    assert set(s["errors"]) <= {"unfinished"}, s["errors"]
    assert s["latency_ms"]["p50"] > 0 and s["tokens_read_per_s"] > 0
    assert {"slowest_branch", "server", "backend", "policy"} <= set(s["stages_ms"])
    report = {"command": "test", "started": "now", "machine": {"cpus": 2, "platform": "x",
                                                                "load_average": "0"},
              "target": {"kind": "driver"}, "workload": {"source": "hotpot-mini",
                                                          "questions": 12, "seed": 0},
              "arrivals": {"loop": "open", "process": "poisson", "step_duration_s": 3,
                           "drain_s": 5, "max_inflight": 256, "think_s": 0}, **out}
    report["plots"] = rep.plots(report, tmp_path)
    assert [Path(p).name for p in report["plots"]] == ["latency.png", "throughput.png",
                                                       "cdf.png"]
    md = rep.write(report, tmp_path / "lt.json").read_text()
    assert "| target rate (req/s) | offered/s |" in md and "**Knee**" in md
    # the column says what it counts: a 503 saying the service cannot search is not in it
    assert "| refused (429, 503 overloaded) | other errors |" in md, md
    assert json.loads((tmp_path / "lt.json").read_text())["steps"][0]["sent"] == s["sent"]


@pytest.fixture(scope="module")
def live_service(hotpot_settings, tmp_path_factory):
    """`branchsearch serve`'s app (uvicorn, in-process executor) on loopback, with two keys, over
    its own copy of hotpot-mini (a Milvus Lite file has one owner). No per-key queue: a key's
    searches past its 4 are refused 429 at once, the refusals these tests count (with the
    default queue they would wait, and count in the latencies)."""
    from branchsearch.orchestrator.service import deploy as service
    from branchsearch.orchestrator.service.admission import Limits
    from branchsearch.orchestrator.service.auth import KeyStore

    from conftest import ingest_copy
    from service_fixtures import start_uvicorn

    settings = ingest_copy(hotpot_settings, "lt-svc").replace(branches=2)
    keys = tmp_path_factory.mktemp("lt-keys") / "keys.json"
    key = KeyStore(keys).add("loadtest", ())
    other = KeyStore(keys).add("loadtest-2", ())  # a second caller (Locust: a key per user)
    state = service.local_state(settings, executor="local", keys_path=keys,
                                limits=Limits(per_key_queue=0))
    state.searcher.target.drivers.open(settings.index)  # opened before any clock runs
    server = start_uvicorn(service.create_app(state), state)
    yield server.url, key, other
    server.stop()
    state.searcher.target.close()


def test_short_real_run_against_a_live_service_stops_on_time(live_service):
    from branchsearch.orchestrator.loadtest.probes import StepProbe

    from conftest import HOTPOT

    url, key, _ = live_service
    target = HttpTarget(url, key, branches=1)
    spec = LoadSpec("closed", (arrivals.Step(2, 2.0),), drain_s=20.0, warmup=0)
    out = Generator(target, Workload(read_questions(HOTPOT)), spec,
                    probe=lambda: StepProbe(None, lambda: target.get("/metrics"))).run()
    s = out["steps"][0]
    assert s["wall_s"] < 2 + 20 + 1
    assert s["ok"] >= 1 and set(s["errors"]) <= {"unfinished"}, s["errors"]
    # (Ray use is probed when this process is connected: an earlier test may have connected it)
    assert s["probes"]["gpu"] and s["probes"]["ray"]
    service_rates = s["probes"]["service_metrics"]
    assert any(k.startswith("branchsearch_searches_total") and v > 0
               for k, v in service_rates.items()), service_rates
    with pytest.raises(RequestFailed) as bad_key:
        HttpTarget(url, "wrong").search("q")
    assert bad_key.value.outcome == "http_401:unauthorized"
    from branchsearch.orchestrator.loadtest.run import preflight

    with pytest.raises(BranchsearchError, match="http_401:unauthorized .*check --url, the key"):
        preflight(HttpTarget(url, "wrong"), "q")  # the CLI stops here: one line, exit 2
    with pytest.raises(RequestFailed) as refused:
        HttpTarget("http://127.0.0.1:9", "k").search("q")  # nothing listens on port 9
    assert refused.value.outcome.startswith("error:")
    # a user and password in --url: one clear line (urllib would take "bob:pw@host" for a host)
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.loadtest.run import Options, make_target

    with pytest.raises(BranchsearchError, match="holds a user or password") as userinfo:
        make_target(Options(url=url.replace("://", "://bob:s3cret@"), keys=("k",)),
                    load_settings(read_env=False, read_file=False), None)
    assert "s3cret" not in str(userinfo.value)
    for bad in ("bob:s3cret@127.0.0.1:1", "http://bob:s3cret@[::1"):  # no scheme; not a URL
        with pytest.raises(BranchsearchError) as refused_url:
            make_target(Options(url=bad, keys=("k",)),
                        load_settings(read_env=False, read_file=False), None)
        assert "s3cret" not in str(refused_url.value), refused_url.value


def test_poisson_bunching_at_a_low_rate_is_no_saturation(live_service):
    """0.5/s for 8 s, --seed 1: four requests at 0.3, 4.1, 6.9 and 7.5 s, each answered in
    well under a second. The achieved rate, read from the completions' span, was 0.436/s of
    0.5/s offered, and the service 'already saturated at the first step' (about one run in ten
    at the README's 0.05/s x 90 s ramp start). The completions' span is the arrivals' span
    shifted: what the service kept up with is what was offered."""
    from conftest import HOTPOT

    url, key, _ = live_service
    spec = LoadSpec("open", (arrivals.Step(0.5, 8.0),), seed=1, drain_s=20.0, warmup=1)
    out = Generator(HttpTarget(url, key, branches=1), Workload(read_questions(HOTPOT)),
                    spec).run()
    s = out["steps"][0]
    assert s["sent"] == s["ok"] == 4 and s["latency_ms"]["max"] < 3000, s
    assert s["achieved_rate"] == pytest.approx(s["offered_rate"], rel=0.05), s
    assert out["knee"]["saturated_at"] is None, out["knee"]


def test_several_keys_load_the_service_as_several_callers(live_service):
    """Each key may have 4 searches in flight (per_key_concurrency): 6 users on one key
    measure that limit (429s), not the service. With two keys each request takes the least
    busy one, 3 in flight each: every request admitted."""
    from conftest import HOTPOT

    url, key, other = live_service
    spec = LoadSpec("closed", (arrivals.Step(6, 3.0),), drain_s=20.0, warmup=0)
    one = Generator(HttpTarget(url, key, branches=1), Workload(read_questions(HOTPOT)),
                    spec).run()["steps"][0]
    two = Generator(HttpTarget(url, (key, other), branches=1), Workload(read_questions(HOTPOT)),
                    spec).run()["steps"][0]
    assert one["refusals"].get("http_429:too_many_requests", 0) > 0, one["errors"]
    assert two["ok"] > 0 and not two["refusals"] and not two["errors"], two["errors"]


def test_locustfile_runs_headless_against_the_live_service(live_service, tmp_path):
    """The recipe for more users than one key admits (per_key_concurrency 4): a file of keys,
    one per user in turn. 5 users on 2 keys (3 and 2 at once): every request admitted."""
    # never import locust here: it monkey-patches threading (gevent) for the whole process
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust is not installed: pip install 'branchsearch[loadtest]'")
    from conftest import HOTPOT

    url, key, other = live_service
    keys = tmp_path / "keys.txt"  # as Windows editors save it: a byte-order mark, CR LF;
    # a comment, as `loadtest --key-file` takes it (each was sent as a key: 401s, or no request)
    keys.write_bytes(f"\ufeff# the load test's callers\r\n{key}\r\n{other}\r\n".encode())
    # --stop-timeout: users finish the search they are in when the 3 s are up (searches take
    # seconds here); the final stats come as JSON on stdout (the CSV is written before that)
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"),
           "--headless", "-u", "5", "-r", "5", "-t", "3s", "--stop-timeout", "60",
           "--host", url, "--json"]
    env = {**os.environ, "BRANCHSEARCH_LOADTEST_KEYS": str(keys),
           "BRANCHSEARCH_LOADTEST_QUERIES": str(HOTPOT), "BRANCHSEARCH_LOADTEST_BRANCHES": "1"}
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert time.monotonic() - started < 3 + 60 + 40, "locust did not stop on time"
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout)
    assert {s["name"] for s in stats} == {"/v1/search"}, stats  # no "/v1/search refused" row
    assert sum(s["num_requests"] for s in stats) >= 5, proc.stderr[-2000:]
    assert sum(s["num_failures"] for s in stats) == 0, proc.stderr[-2000:]


def test_locust_users_wait_the_retry_after_of_a_refusal(tmp_path):
    """Four locust users on a service that runs one search at a time and queues none
    (`max_in_flight` 1, `Retry-After: 1`): a refused user waits the second the service asked
    for before asking again, so in 3 s each is refused a few times, not hundreds (a refusal
    answers in milliseconds)."""
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust is not installed: pip install 'branchsearch[loadtest]'")
    from conftest import HOTPOT

    from branchsearch.orchestrator.service.admission import Limits

    with _service_over_es(tmp_path, limits=Limits(max_in_flight=1, retry_after_s=1)) \
            as (server, _):
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"),
               "--headless", "-u", "4", "-r", "4", "-t", "3s", "--stop-timeout", "30",
               "--host", server.url, "--json"]
        env = {**os.environ, "BRANCHSEARCH_LOADTEST_QUERIES": str(HOTPOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: locust saw failures
    stats = {s["name"]: s for s in json.loads(proc.stdout)}
    refused = stats.get("/v1/search refused", {}).get("num_requests", 0)
    assert 1 <= refused <= 4 * 5, (refused, stats.keys())  # at most ~1 a second a user


def test_closed_loop_users_wait_the_retry_after_of_a_refusal(tmp_path):
    """`branchsearch loadtest --users 2` for 3 s on a key whose one slot is held and that
    queues nothing (`Retry-After: 2`): every request is refused 429 at once, and a refused user
    waits the 2 s the service asked for before asking again (as the locustfile's users do), so
    each is refused twice, not every half second."""
    from branchsearch.orchestrator.service.admission import Limits

    out = tmp_path / "lt.json"
    with _service_over_es(tmp_path, limits=Limits(per_key_concurrency=1, per_key_queue=0,
                                                  retry_after_s=2)) as (server, _):
        held = server.state.searcher.target.concurrency.take("dev")  # the dev mode's key
        try:
            proc = _cli_loadtest(server.url, ["--users", "2", "--duration", "3",
                                              "--report", str(out)], {}, tmp_path)
        finally:
            held.let_go()
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads(out.read_text())["steps"][0]
    assert step["refused"] == step["sent"], step
    assert 2 <= step["sent"] <= 2 * (3 // 2 + 1), step  # each at 0 s and 2 s, not 6 a user


def test_a_retry_after_is_read_as_the_locustfile_reads_it():
    """Seconds, at most 60; no header, a date or no number: None (the fixed back-off)."""
    from branchsearch.orchestrator.loadtest.targets import MAX_BACK_OFF_S, retry_after_s

    assert MAX_BACK_OFF_S == 60.0
    assert retry_after_s("2") == 2.0 and retry_after_s(" 1.5 ") == 1.5
    assert retry_after_s("3600") == 60.0 and retry_after_s("-3") == 0.0
    for none in (None, "", "Wed, 21 Oct 2026 07:28:00 GMT", "soon", "nan", "inf"):
        assert retry_after_s(none) is None, none


def test_the_key_comes_from_a_file_or_the_environment_and_is_never_written(tmp_path):
    from branchsearch.orchestrator.loadtest.run import read_keys, redact_argv, scrub

    f = tmp_path / "k"
    f.write_text("bs_secret-1\n")
    assert read_keys(f, None, {"BRANCHSEARCH_API_KEY": "other"}) == (("bs_secret-1",),
                                                                     f"--key-file {f}")
    assert read_keys(None, None, {"BRANCHSEARCH_API_KEY": " bs_env "}) == \
        (("bs_env",), "BRANCHSEARCH_API_KEY")
    assert read_keys(None, "bs_flag", {"BRANCHSEARCH_API_KEY": "x"}) == (("bs_flag",), "--key")
    assert read_keys(None, None, {}) == ((), "none")
    notepad = tmp_path / "bom"  # as Windows editors save it: a byte-order mark, CR LF lines
    notepad.write_bytes("\ufeffbs_a\r\nbs_b\r\n".encode())  # (the BOM read as part of key
    # 1, refused as "a character outside ASCII")
    assert read_keys(notepad, None, {}) == (("bs_a", "bs_b"), f"--key-file {notepad} (2 keys)")
    several = tmp_path / "keys"  # one a line; comments, blank lines and repeats skipped
    several.write_text("# the load test's callers\nbs_a\n\n bs_b \nbs_a\n")
    assert read_keys(several, None, {}) == (("bs_a", "bs_b"),
                                            f"--key-file {several} (2 keys)")
    for bad, why in ((tmp_path / "missing", "cannot read"), (tmp_path, "cannot read")):
        with pytest.raises(BranchsearchError, match=why):
            read_keys(bad, None, {})
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(BranchsearchError, match="is empty"):
        read_keys(tmp_path / "empty", None, {})
    with pytest.raises(BranchsearchError, match="once"):
        read_keys(f, "k", {})
    # a key no HTTP header carries was never sent, and read "the answer is not JSON"
    for bad in ("ключ-s3cret", "bs_a\r\nX-Evil: s3cret", "bs a s3cret", "bs_\x00s3cret"):
        with pytest.raises(BranchsearchError, match="BRANCHSEARCH_API_KEY: the key holds a "
                                                    "space, a control character or a "
                                                    "character outside ASCII") as refused:
            read_keys(None, None, {"BRANCHSEARCH_API_KEY": bad})
        assert "s3cret" not in str(refused.value)
    (tmp_path / "two").write_text("bs_ok\nbs_ключ\n")
    with pytest.raises(BranchsearchError, match="two: key 2 of 2 holds a space"):
        read_keys(tmp_path / "two", None, {})
    assert scrub({"a": "bs_a and bs_b"}, ("bs_a", "bs_b")) == {"a": "REDACTED and REDACTED"}
    assert redact_argv(["bs", "loadtest", "--key", "s3", "--key=s3", "--url", "u"]) == \
        ["bs", "loadtest", "--key", "REDACTED", "--key=REDACTED", "--url", "u"]
    assert scrub({"a": ["x s3 y", 3, {"b": "s3"}], "c": None}, "s3") == \
        {"a": ["x REDACTED y", 3, {"b": "REDACTED"}], "c": None}


def _cli_loadtest(url: str, args: list[str], env: dict, home: Path) -> subprocess.CompletedProcess:
    from conftest import HOTPOT

    env = {k: v for k, v in os.environ.items() if k != "BRANCHSEARCH_API_KEY"} | env
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--url", url,
           "--queries", str(HOTPOT), "--home", str(home), "--branches", "1", "--warmup", "0",
           "--drain", "60", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_cli_against_a_live_service_writes_no_key_and_counts_refusals_apart(live_service,
                                                                           tmp_path):
    """`branchsearch loadtest` against the real service with one key: 6 users over a per-key
    limit of 4. The key (from --key-file, or the old --key) is in no report, line or output;
    the 429s are counted apart and are not in the latency percentiles."""
    url, key, _ = live_service
    key_file = tmp_path / "lt.key"
    key_file.write_text(key + "\n")
    out = tmp_path / "out" / "lt.json"
    proc = _cli_loadtest(url, ["--key-file", str(key_file), "--users", "6", "--think", "0.2",
                               "--duration", "3", "--report", str(out)], {}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {p.name: p.read_text() for p in out.parent.iterdir()}
    assert set(written) == {"lt.json", "lt.md"}
    for name, text in {**written, "stdout": proc.stdout, "stderr": proc.stderr}.items():
        assert key not in text, name
    report = json.loads(written["lt.json"])
    assert report["target"]["key"] == f"from --key-file {key_file}"
    step = report["steps"][0]
    assert step["refused"] >= 1 and set(step["refusals"]) == {"http_429:too_many_requests"}
    assert step["ok"] >= 1 and step["refusal_rate"] == pytest.approx(step["refused"] /
                                                                     step["sent"], abs=1e-3)
    # the percentiles and the CDF hold the searches only, every one of them
    assert len(step["latencies_ms"]) == step["sent"] - step["refused"]
    assert step["refusal_latency_ms"]["max"] > 0  # timed apart (no order asserted: a loaded
    # machine can answer a 429 slower than a search)
    # the column counts 429s and 503 overloaded, not the 503s saying it cannot search
    column = "refused (429, 503 overloaded)"
    assert column in written["lt.md"] and column in proc.stdout
    # its 429s say the key has no queue (per_key_queue 0): the note says so, and no note
    # speaks of requests waiting in one
    note = [n for n in report["notes"] if "per_key_queue" in n]
    assert len(note) == 1 and re.fullmatch(
        r"the key's own concurrency limit refused \d+ requests at once \(429 "
        r"too_many_requests\): past its 4 running \(per_key_concurrency 4\) the service "
        r"queues none \(per_key_queue 0\), and refusals count as errors: past that limit this "
        r"measures the key, not the service; put several keys in --key-file \(one a line: "
        r"each request takes the least busy\), or give the service a per_key_queue \(a key's "
        r"requests past its slots then wait for one\) or a larger per_key_concurrency",
        note[0]), report["notes"]
    assert note[0] in written["lt.md"]

    # the old flag still works: warned, and the key is shown nowhere (the command line in
    # the JSON on stdout says --key REDACTED)
    proc = _cli_loadtest(url, ["--key", key, "--users", "1", "--duration", "1", "--json"], {},
                         tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert key not in proc.stdout and key not in proc.stderr
    assert "--key REDACTED --users" in json.loads(proc.stdout)["command"]
    assert "warning: --key shows the key" in proc.stderr


def test_cli_note_on_429s_names_the_keys_given(live_service, tmp_path):
    """10 users on a --key-file of 2 keys (4 searches each at once): the 429s' note told the
    user to do what they had done ("put several keys in --key-file"). It now says how many
    keys' limits refused them."""
    url, key, other = live_service
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{key}\n{other}\n")
    out = tmp_path / "lt.json"
    proc = _cli_loadtest(url, ["--key-file", str(keys), "--users", "10", "--think", "0.2",
                               "--duration", "3", "--report", str(out)], {}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["steps"][0]["refusals"].get("http_429:too_many_requests"), report["steps"]
    note = [n for n in report["notes"] if "429" in n]
    assert len(note) == 1 and re.fullmatch(
        r"the 2 keys' own concurrency limits refused \d+ requests at once \(429 "
        r"too_many_requests\): past each key's 4 running \(per_key_concurrency 4\) the "
        r"service queues none \(per_key_queue 0\), and refusals count as errors: past that "
        r"limit this measures the keys, not the service; add keys to --key-file, or give the "
        r"service a per_key_queue \(a key's requests past its slots then wait for one\) or a "
        r"larger per_key_concurrency", note[0]), report["notes"]


def test_cli_more_users_than_a_key_has_slots_says_its_queue_wait_is_in_the_latency(tmp_path):
    """6 users on one key of a service with the default limits (4 slots a key, a queue of 16
    past them): no 429, and the report said nothing of the users past the key's slots, whose
    latency held their wait in the key's queue. It now says so; against a service whose 429s
    say it has no queue (`live_service`), only the 429 note is given."""
    out = tmp_path / "lt.json"
    with _service_over_es(tmp_path) as (server, _):
        proc = _cli_loadtest(server.url, ["--users", "6", "--duration", "2", "--report",
                                          str(out)], {}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["steps"][0]["refused"], report["steps"][0]["refusals"]
    note = [n for n in report["notes"] if "per_key_queue" in n]
    assert note == ["up to 6 of one key's requests were under way at once (sent and not "
                    "refused at once), past the service's default per_key_concurrency of 4 "
                    "(unless this service allows a key more): those past the slots waited in "
                    "the key's queue (per_key_queue), and that wait is in the latency of those "
                    "it then answered (stage outside_server): this measures the key's queue as "
                    "well as the service; add keys to --key-file or raise the service's "
                    "per_key_concurrency"], report["notes"]
    assert f"> {note[0]}" in (tmp_path / "lt.md").read_text()
    # the slots a 429 named; none said when they were not passed, or there is no queue
    from branchsearch.orchestrator.loadtest.run import key_queue_note

    assert key_queue_note(3, 2, None).startswith("up to 3 of one key's requests were under "
                                                 "way at once (sent and not refused at "
                                                 "once), past its 2 slots "
                                                 "(per_key_concurrency, as the service's "
                                                 "refusals said): ")
    assert key_queue_note(4, None, None) == key_queue_note(5, 4, 0) == ""


def test_a_long_run_keeps_few_spans_and_the_same_peak_per_key(monkeypatch):
    """A load test of an hour keeps a bounded number of request spans (folded as they settle)
    and still counts the most of one key's requests under way at once exactly."""
    monkeypatch.setattr(targets, "FOLD_AT", 16)
    now = [0.0]
    monkeypatch.setattr(targets.time, "monotonic", lambda: now[0])
    rng = random.Random(7)
    requests = sorted((start, start + rng.expovariate(1.0))
                      for start in np.cumsum([rng.expovariate(4.0) for _ in range(3000)]))
    moments = sorted([(s, 1, i) for i, (s, _) in enumerate(requests)]
                     + [(e, 0, i) for i, (_, e) in enumerate(requests)])
    target, open_ = HttpTarget("http://127.0.0.1:9"), {}
    most_kept = 0
    for at, starts, i in moments:
        now[0] = at
        if starts:
            held = target._key()
            open_[i] = (held, held.__enter__())
        else:
            held, (key, sent) = open_.pop(i)
            target._count(key, sent, "")
            held.__exit__(None, None, None)
            most_kept = max(most_kept, len(target._taken[None]))
    assert target.most_per_key == most_at_once(requests) > 4
    assert most_kept < 200  # not 3,000


def test_cli_429s_of_a_full_key_queue_say_so_and_count_only_what_it_took(tmp_path):
    """`serve --standalone` with 1 slot and a queue of 1 a key, 6 users on its one key: the
    service ran 1 and queued 1 and refused the rest 429 at once. The report names the full
    queue and its limits (read from the 429's fields, not its prose) and counts the 2 the
    service held, not the requests it refused."""
    from branchsearch.orchestrator.service.admission import Limits

    report = _six_users_for_two_seconds(tmp_path, Limits(per_key_concurrency=1,
                                                         per_key_queue=1))
    assert report["steps"][0]["refusals"].get("http_429:too_many_requests"), report["steps"]
    refused = [n for n in report["notes"] if "429" in n]
    assert len(refused) == 1 and re.fullmatch(
        r"the key's queue was full: \d+ requests were refused at once \(429 "
        r"too_many_requests\) while 1 ran and 1 waited \(per_key_concurrency 1, per_key_queue "
        r"1\), and refusals count as errors: past that this measures the key, not the "
        r"service; put several keys in --key-file \(one a line: each request takes the least "
        r"busy\) or raise the service's per_key_queue", refused[0]), report["notes"]
    queued = [n for n in report["notes"] if n.startswith("up to ")]
    assert queued and queued[0].startswith(
        "up to 2 of one key's requests were under way at once (sent and not refused at once), "
        "past its 1 slot (per_key_concurrency, as the service's refusals said): "), queued


def test_cli_429s_after_waiting_past_the_deadline_say_so(tmp_path):
    """The key's one slot held (a search of its that does not end), `--deadline-s 0.5`: each
    request waited in the key's queue until its deadline and was refused 429. The report says
    they waited past their deadline, and what that asks for (not the no-queue advice)."""
    from branchsearch.orchestrator.service.admission import Limits

    out = tmp_path / "lt.json"
    with _service_over_es(tmp_path, limits=Limits(per_key_concurrency=1, per_key_queue=4)) \
            as (server, _):
        held = server.state.searcher.target.concurrency.take("dev")  # the dev mode's key
        try:
            proc = _cli_loadtest(server.url, ["--users", "2", "--duration", "1.5",
                                              "--deadline-s", "0.5", "--report", str(out)], {},
                                 tmp_path)
        finally:
            held.let_go()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    refused = [n for n in report["notes"] if "429" in n]
    assert len(refused) == 1 and re.fullmatch(
        r"\d+ of the key's requests waited in its queue behind its 1 running "
        r"\(per_key_concurrency 1, per_key_queue 4\) until their deadline \(--deadline-s 0.5\) "
        r"and were refused \(429 too_many_requests\), and refusals count as errors: the key's "
        r"requests wait longer than their deadline allows; give a longer --deadline-s, put "
        r"several keys in --key-file \(one a line: each request takes the least busy\) or "
        r"raise the service's per_key_concurrency", refused[0]), report["notes"]


def test_cli_report_says_why_the_slo_broke(live_service, tmp_path):
    """Against the real service, an SLO no step can hold: the report's SLO line named two of
    its three criteria and not why it was not held. It now says at which step, and why."""
    url, key, _ = live_service
    out = tmp_path / "slo.json"
    proc = _cli_loadtest(url, ["--rate", "2", "--duration", "2", "--slo-p99-ms", "0.001",
                               "--report", str(out)], {"BRANCHSEARCH_API_KEY": key}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["slo"]["holds_up_to"] is None
    assert report["slo"]["broken_at"]["load"] == 2
    assert report["slo"]["broken_at"]["reason"].endswith("ms > 0.001 ms")
    line = [x for x in out.with_suffix(".md").read_text().splitlines()
            if x.startswith("**SLO")][0]
    assert line.startswith("**SLO p99 ≤ 0.001 ms, errors ≤ 1 %, achieved ≥ 90 % of offered**: "
                           "not held at any step; broken at 2: p99 "), line


def test_a_report_the_disk_cannot_hold_is_not_left_half_written(tmp_path, monkeypatch):
    """A full disk while the report was written left OUT.json cut in the middle (not JSON) over
    the last run's; now each file is whole or untouched, and no temporary copy stays."""
    import errno

    from branchsearch.orchestrator.loadtest import report as rep

    (tmp_path / "lt.json").write_text('{"steps": []}\n')  # the last run's report
    real = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError):
        rep.write({"steps": [], "notes": ["x" * 1000]}, tmp_path / "lt.json")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["lt.json"]
    assert json.loads((tmp_path / "lt.json").read_text()) == {"steps": []}


@pytest.mark.parametrize("flags, says", [
    (["--ramp", "1:2"], "--ramp"),
    (["--rate", "5", "--step-duration", "-1"], "--step-duration -1: must be > 0"),
    (["--users", "1", "--step-duration", "0"], "--step-duration 0: must be > 0")])
def test_cli_user_errors_are_one_line_exit_2(tmp_path, flags, says):
    """`--step-duration -1` without a ramp was dropped without a word (the run went on with
    --duration): a length or rate of the wrong sign is one error line wherever it is given."""
    proc = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest",
                           "--queries", str(tmp_path / "none.jsonl"), *flags,
                           "--home", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and says in proc.stderr, proc.stderr


@pytest.mark.parametrize("options", [
    {"rate": float("nan")}, {"rate": float("inf")}, {"users": float("inf")},
    {"ramp": "nan:1:1"}, {"ramp": "1:inf:1"}, {"rate": 1.0, "duration_s": float("nan")},
    {"ramp": "1:2:1", "step_duration_s": float("nan")}, {"rate": 1.0, "drain_s": float("inf")}])
def test_nan_and_inf_are_refused_before_anything_runs(options):
    """A run is bounded in time only with numbers: nan and inf are one error line before
    anything runs (no hang, no traceback, no `offered nan/s`)."""
    from branchsearch.orchestrator.loadtest.run import Options, load_spec

    with pytest.raises(BranchsearchError, match="nan or inf"):
        load_spec(Options(**options))


@pytest.mark.parametrize("options, says", [
    ({"rate": 1.0, "deadline_s": 0.0}, "--deadline-s 0: must be > 0"),
    ({"rate": 1.0, "deadline_s": -1.0}, "--deadline-s -1: must be > 0"),
    ({"rate": 1.0, "slo_p99_ms": -3.0}, "--slo-p99-ms -3: must be > 0"),
    ({"rate": 1.0, "timeout_s": 0.0}, "--timeout-s 0: must be > 0"),
    ({"rate": 1.0, "step_duration_s": -1.0}, "--step-duration -1: must be > 0"),
    ({"users": 2, "step_duration_s": 0.0}, "--step-duration 0: must be > 0"),
    ({"ramp": "1:2:1", "step_duration_s": -5.0}, "--step-duration -5: must be > 0"),
    ({"rate": 0.0}, "--rate 0: must be > 0"), ({"rate": -1.0}, "--rate -1: must be > 0"),
    ({"users": 0}, "--users 0: must be > 0"),
    ({"rate": 1.0, "duration_s": -2.0}, "--duration -2: must be > 0"),
    ({"rate": 1.0, "drain_s": -1.0}, "--drain -1: must be >= 0"),
    ({"users": 2, "think_s": -0.5}, "--think -0.5: must be >= 0"),
    ({"rate": 1.0, "max_inflight": 0}, "--max-inflight 0: must be >= 1"),
    ({"users": 2, "arrivals": "constant"}, "drop --arrivals"),
    ({"rate": 1.0, "think_s": 1.0}, "drop --think")])
def test_values_that_would_fail_every_request_or_change_nothing_are_refused(options, says):
    """A deadline of 0 would fail every request (read as saturation), a negative SLO judge
    nothing, --arrivals with --users or --think with --rate change nothing: each is one error
    line before anything runs."""
    from branchsearch.orchestrator.loadtest.run import Options, load_spec

    with pytest.raises(BranchsearchError, match=re.escape(says)):
        load_spec(Options(**options))
    assert load_spec(Options(users=2, think_s=1.0))[0].think_s == 1.0  # where they belong
    assert load_spec(Options(rate=1.0, arrivals="constant"))[0].process == "constant"
    assert load_spec(Options(rate=1.0))[0].process == "poisson"
    assert load_spec(Options(users=2, drain_s=0.0))[0].drain_s == 0.0  # 0: no wait


@pytest.mark.parametrize("options, says", [
    ({"rate": 1e9, "duration_s": 2.0}, "1e+09/s for 2 s: 2e+09 requests in a step, at most "
                                       "100,000"),
    ({"ramp": "10:100000:50000", "step_duration_s": 5.0}, "50010/s for 5 s: 2.5e+05 requests"),
    ({"users": 50_000, "duration_s": 2.0}, "50000 users: at most 10,000 users"),
    ({"rate": 5.0, "max_inflight": 10**7}, "--max-inflight 10000000: at most 10,000"),
    ({"rate": 1.0, "duration_s": 0.001}, "--duration 0.001: a step must last at least 1 s"),
    ({"users": 2, "duration_s": 0.001}, "--duration 0.001: a step must last at least 1 s"),
    ({"ramp": "1:2:1", "step_duration_s": 0.2}, "--step-duration 0.2: a step must last"),
    ({"rate": 0.5, "duration_s": 1.5, "arrivals": "constant"}, "0.5/s for 1.5 s is less "
                                                               "than one request a step"),
    ({"rate": 1.0, "duration_s": 1.0}, "1/s for 1 s sends no request (the poisson arrivals "
                                       "of --seed 0): lengthen --duration")])
def test_a_step_sends_something_and_no_more_than_one_process_can(options, says):
    """`--rate 1e9` drew 2e9 send times before its first request and never ended (a 2e5/s step
    of 2 s ran 6 s); `--duration 0.001` sent nothing and reported 'no answers, errors 0.0 %',
    the knee 'not reached'; a constant rate under one request a step sent one and called it
    1000/s. Each is one error line before anything runs."""
    from branchsearch.orchestrator.loadtest.run import Options, load_spec

    started = time.monotonic()
    with pytest.raises(BranchsearchError, match=re.escape(says)):
        load_spec(Options(**options))
    assert time.monotonic() - started < 2
    assert load_spec(Options(rate=1.0, duration_s=2.0))[0].steps[0].duration_s == 2.0


def test_a_url_with_a_query_is_refused_and_its_query_never_shown(live_service, tmp_path):
    """`--url http://host:port/?token=…`: every request went to `/?token=…/v1/search`, a
    405, and the report (exit 0) printed the token three times. It is now one line, exit 2,
    without the query; and a first question answered by any 4xx but 429 (here that 405)
    stops the run before any load."""
    from branchsearch.orchestrator.loadtest.run import preflight

    url, key, _ = live_service
    proc = _cli_loadtest(url + "/?token=s3cretq", ["--rate", "1", "--duration", "2", "--report",
                                                   str(tmp_path / "lt.json")],
                         {"BRANCHSEARCH_API_KEY": key}, tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "without a ?query or #fragment" in proc.stderr
    assert "s3cretq" not in proc.stdout + proc.stderr and not (tmp_path / "lt.json").exists()
    with pytest.raises(BranchsearchError, match="the first question got http_405"):
        preflight(HttpTarget(url + "/?token=s3cretq", key), "Who built the lighthouse?")


@pytest.mark.parametrize("url, shown", [
    ("http://bob:pw@127.0.0.1:1/?key=s3cretq", "***@127.0.0.1:1/…"),
    ("ftp://127.0.0.1:1/?key=s3cretq", "ftp://127.0.0.1:1/…"),
    ("127.0.0.1:1?key=s3cretq", "127.0.0.1:1…"), ("http://[::1/?key=s3cretq", "http://[::1/…"),
    ("http://127.0.0.1:1/#s3cretq", "http://127.0.0.1:1/…")])
def test_a_refused_url_never_shows_its_query(url, shown):
    """A --url refused for its scheme, its syntax or its user and password printed its
    ?query whole (`--url '***@127.0.0.1:1/?key=s3cretq' holds a user or password`): the
    address is shown without it."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.loadtest.run import Options, make_target

    with pytest.raises(BranchsearchError) as refused:
        make_target(Options(url=url, keys=("k",)),
                    load_settings(read_env=False, read_file=False), None)
    assert "s3cretq" not in str(refused.value) and shown in str(refused.value)


def test_every_key_of_a_key_file_is_tried_before_any_load(live_service, tmp_path):
    """A --key-file whose second key the service does not know: the first question went with
    the first key only, so the run began and one request in two was a 401. Each key is now
    asked the first question: one line naming which key (never the key), exit 2."""
    url, key, _ = live_service
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{key}\nbs_not_a_key_s3cret\n")
    proc = _cli_loadtest(url, ["--key-file", str(keys), "--users", "2", "--duration", "2",
                               "--report", str(tmp_path / "lt.json")], {}, tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "the first question with key 2 of 2 got http_401:unauthorized" in proc.stderr
    assert "s3cret" not in proc.stdout + proc.stderr and not (tmp_path / "lt.json").exists()


def test_requests_the_service_rejects_are_no_fast_answers_and_no_knee(live_service):
    """A workload whose questions the service partly rejects (422: a question it cannot
    search): the fast 422s entered the latency percentiles and the knee read 'saturated at
    3: errors 14.8 %'. They are counted apart as rejected, stay out of the percentiles, and
    no knee is drawn from them; the ramp stops there."""
    from conftest import HOTPOT

    url, key, _ = live_service
    questions = read_questions(HOTPOT)[:3] + ["?!"]  # the file check would refuse it
    spec = LoadSpec("closed", (arrivals.Step(1, 2.0), arrivals.Step(2, 2.0)), drain_s=30.0,
                    warmup=0)
    out = Generator(HttpTarget(url, key, branches=1), Workload(questions, seed=1),
                    spec).run()
    step, = out["steps"]  # the ramp stopped after the step with rejections
    assert step["rejected"] >= 1 and step["rejections"] == {
        "http_422:bad_request": step["rejected"]}, step["errors"]
    assert len(step["latencies_ms"]) == step["sent"] - step["rejected"] == step["ok"]
    assert out["knee"]["knee"] is None and out["knee"]["saturated_at"] is None
    assert f"the service rejected {step['rejected']} of {step['sent']} requests at step 1 " \
           "(http_422:bad_request" in out["knee"]["reason"]
    assert out["stopped"].startswith("stopped after step 1: the service rejected")


def test_cli_rejections_during_the_run_keep_the_report_and_exit_1(live_service, tmp_path):
    """A question the file check accepts but this service rejects (422 question_too_long:
    over its max_question_chars), asked after the first: the run exited 0 with a knee drawn
    from the 422s. The report is kept, says what was rejected, and the exit status is 1."""
    url, key, _ = live_service
    short, long = "Who built the Old Lighthouse?", "Which harbor festival " * 60 + "?"
    seed = next(s for s in range(20) if Workload([short, long], s).question(0) == short)
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"question": short}) + "\n" + json.dumps({"question": long})
                       + "\n")
    out = tmp_path / "lt.json"
    cmd = [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--url", url,
           "--queries", str(queries), "--seed", str(seed), "--home", str(tmp_path), "--users",
           "1", "--duration", "2", "--warmup", "0", "--branches", "1", "--report", str(out)]
    env = {**os.environ, "BRANCHSEARCH_API_KEY": key}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    step, = json.loads(out.read_text())["steps"]
    assert step["rejections"] == {"http_422:question_too_long": step["rejected"]} and step["ok"]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "loadtest: the service rejected "), proc.stderr[-2000:]
    assert "the report keeps what was measured" in proc.stderr


def test_a_deadline_the_unloaded_service_never_meets_is_one_error_before_any_load(
        live_service):
    """`--deadline-s 0.0001`: every request answered 504 within a millisecond, and the run
    read 'already saturated at the first step: errors 100.0%', exit 0. The first question,
    asked twice before any load, finds it: one line naming the flag, no load sent."""
    from branchsearch.orchestrator.loadtest.run import preflight

    url, key, _ = live_service
    with pytest.raises(BranchsearchError) as short:
        preflight(HttpTarget(url, key, deadline_s=0.0001), "Who directed Ed Wood?")
    assert str(short.value).startswith(f"--url {url}: the first question got "
                                       "http_504:deadline_exceeded (")
    assert str(short.value).endswith("twice, before any load: the service does not answer "
                                     "within --deadline-s 0.0001 even unloaded, so no load was "
                                     "sent; give a longer --deadline-s")
    preflight(HttpTarget(url, key, deadline_s=60), "Who directed Ed Wood?")  # one it meets


def test_a_service_that_is_gone_is_no_fast_answer_and_is_not_hammered():
    """Against a port nothing listens on (the service died): each request is an error that
    reached no service, kept out of the latency percentiles (milliseconds of "connection
    refused" made a dead service look fast), and closed-loop users back off instead of
    sending thousands of requests a second."""
    import socket

    from branchsearch.orchestrator.loadtest.generator import BACKOFF_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    gone = HttpTarget(f"http://127.0.0.1:{port}", timeout_s=5)
    out, _ = _run(gone, loop="closed", loads=(2.0,), duration=2.0)
    step = out["steps"][0]
    assert step["ok"] == 0 and step["unreached"] == step["sent"] >= 2
    assert step["latency_ms"]["p50"] is None and step["latencies_ms"] == []
    assert step["sent"] <= 2 * (2.0 / BACKOFF_S + 1)
    out, _ = _run(gone, loads=(10.0,), process="constant", duration=1.0)
    step = out["steps"][0]
    assert step["unreached"] == step["sent"] == 10 and step["latency_ms"]["p50"] is None
    assert step["error_rate"] == 1.0
    # a ramp at a service that is gone: no knee drawn from it, and the ramp stops there
    out, _ = _run(gone, loads=(4.0, 8.0, 12.0), process="constant", duration=0.5,
                  stop_at_knee=False)
    assert len(out["steps"]) == 1 and "unreachable at step 1" in out["knee"]["reason"]
    assert out["knee"]["knee"] is None and "unreachable" in out["stopped"]


def test_a_service_that_dies_partway_through_a_step_is_no_saturation_point():
    """A service killed partway through a step: a third of its requests reached no service, the
    last one among them, so the service went away; no knee is drawn from it (errors > 1 % would
    otherwise read as saturation at the first step)."""
    samples = [Sample(0, scheduled=i, sent=i, done=i + 0.5, outcome="ok") for i in range(10)]
    samples += [Sample(0, scheduled=10 + i, sent=10 + i, done=10 + i,
                       outcome="error:ConnectionRefusedError") for i in range(5)]
    step = summarize(samples, load=3, loop="closed", duration_s=15.0, cutoff=16.0)
    assert step["unreached"] == 5 and step["ended_unreached"]
    knee = find_knee([step])
    assert knee["knee"] is None and knee["saturated_at"] is None
    assert "unreachable at step 1" in knee["reason"] and "the last one among them" in knee["reason"]
    # a service that lost connections midway but answered again by the step's end: saturation
    samples.append(Sample(0, scheduled=20, sent=20, done=20.5, outcome="ok"))
    step = summarize(samples, load=3, loop="closed", duration_s=21.0, cutoff=22.0)
    assert not step["ended_unreached"]
    assert find_knee([step])["saturated_at"] == 3


@pytest.mark.parametrize("stop, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_keeps_the_step_under_way_and_exits_130(tmp_path, stop, status):
    """^C during a step: the report holds what it measured so far (the step marked partial),
    and the exit status says the run was interrupted. A SIGTERM (`timeout`, a cancelled CI
    job, `kill PID`) killed the run with no report at all (exit -15); it now stops it as ^C
    does, exit 143."""
    import signal

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    from conftest import HOTPOT, prepared

    home = tmp_path / "home"
    ingest(HOTPOT, load_settings(overrides={"home": home, "index": "wiki"}, read_env=False,
                                 read_file=False), dense=False)

    out = tmp_path / "lt.json"
    proc = subprocess.Popen(  # ^C handled by default, not ignored nor blocked
        prepared([sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--home",
                  str(home), "--index", "wiki", "--queries", str(HOTPOT), "--executor", "local",
                  "--rate", "5", "--duration", "60", "--warmup", "0", "--report", str(out)],
                 sigint_default=True),
        env={**os.environ, "BRANCHSEARCH_SEARCH_MODE": "bm25"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while time.time() < deadline and not any(" done " in line and "done 0 " not in line
                                             for line in lines):
        time.sleep(0.2)  # a progress line with answers in it
    proc.send_signal(getattr(signal, stop))
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    assert proc.returncode == status, (proc.returncode, "".join(lines)[-2000:])
    report = json.loads(out.read_text())
    step, = report["steps"]
    assert step["partial"] and step["ok"] >= 1 and step["wall_s"] < 60
    assert report["notes"][0].startswith("interrupted (" + {"SIGINT": "Ctrl-C"}.get(stop, stop))
    assert "(partial)" in stdout and "Traceback" not in "".join(lines)


def test_synth_ingests_its_corpus_once_and_refuses_an_index_of_another(tmp_path):
    """`loadtest --synth N --index I` ingests N tasks' corpus into a missing I, then loads it.
    Asked later with another N, the same index would be asked about documents it does not
    hold (searches that find nothing, measured as if they were real): one error line."""
    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--home",
           str(tmp_path), "--index", "lsyn", "--executor", "local", "--rate", "2",
           "--duration", "1", "--warmup", "0"]
    first = subprocess.run([*cli, "--synth", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "missing: ingesting the synth corpus" in first.stderr
    other = subprocess.run([*cli, "--synth", "3"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr[-2000:]
    assert "was ingested from" in other.stderr and "--synth 3 --seed 0" in other.stderr
    again = subprocess.run([*cli, "--synth", "2"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "ingesting" not in again.stderr, again.stderr[-2000:]


# --- a backend that goes away is no saturation ----------------------------------------------------

@pytest.mark.parametrize("outcome, refusal, unavailable", [
    ("http_429:too_many_requests", True, False),
    ("http_503:overloaded", True, False),
    ("http_503", True, False),  # a proxy's bare 503: "not now", as before
    ("http_503:backend_unavailable", False, True),
    ("http_503:search_failed", False, True),
    ("http_503:not_ready", False, True),
    ("http_503:index_starting", False, True),
    ("http_503:shutting_down", False, True),
    ("unavailable:backend_unavailable", False, True),  # the in-process driver's: its backend
    ("unavailable:search_failed", False, True),  # down, or every branch failed
    ("failed", False, False),  # every branch out of time: a deadline load can make it miss
    ("http_504:deadline_exceeded", False, False),
    ("ok", False, False),
])
def test_a_503_is_overload_or_a_service_that_cannot_search_by_its_code(outcome, refusal,
                                                                       unavailable):
    from branchsearch.orchestrator.loadtest.stats import is_refusal, is_unavailable, is_unserved

    assert is_refusal(outcome) is refusal
    assert is_unavailable(outcome) is unavailable
    assert is_unserved(outcome) is (refusal or unavailable)


def test_a_failed_result_is_what_the_service_answers_it_with():
    """The in-process driver's failed result reads as the service's 503 would: every branch
    that erred ended on its backend -> backend_unavailable; erred otherwise -> search_failed;
    every branch out of time is a deadline missed (the service's 504), and no failure at all
    is an answer."""
    from branchsearch.orchestrator.loadtest.targets import failure_code

    down = {"status": "error", "termination": "backend_error", "error": "BackendUnavailable"}
    assert failure_code({"status": "failed", "branches": [down, down]}) == "backend_unavailable"
    assert failure_code({"status": "failed", "branches": [
        down, {"status": "error", "termination": "", "error": "ValueError: x"}]}) \
        == "search_failed"
    assert failure_code({"status": "failed", "branches": [{"status": "timeout"}] * 2}) == ""
    assert failure_code({"status": "failed", "branches": [down, {"status": "timeout"}]}) \
        == "backend_unavailable"
    assert failure_code({"status": "partial", "branches": [down, {"status": "ok"}]}) == ""
    assert failure_code({"branches": [{"status": "ok"}]}) == ""


def test_a_step_whose_backend_went_away_draws_no_knee():
    """A ramp whose second step got 503 backend_unavailable (the index's backend died between
    the steps): the 503s counted as refusals ("not now, retry" = overload) and the knee read
    'saturated at 2: errors 50.0 %'. They are counted apart as unavailable, stay out of the
    percentiles and the refusals, and no knee is drawn from them."""
    first = summarize([Sample(0, i, i, i + 0.5, "ok") for i in range(6)], load=1,
                      loop="closed", duration_s=6.0, cutoff=7.0)
    samples = [Sample(1, i, i, i + 0.5, "ok") for i in range(3)]
    samples += [Sample(1, 3 + i, 3 + i, 3.01 + i, "http_503:backend_unavailable")
                for i in range(3)]
    second = summarize(samples, load=2, loop="closed", duration_s=6.0, cutoff=7.0)
    assert second["unavailable"] == 3 and second["refused"] == 0
    assert second["unavailabilities"] == {"http_503:backend_unavailable": 3}
    assert second["latency_ms"]["max"] == pytest.approx(500)  # the three searches only
    knee = find_knee([first, second])
    assert knee["knee"] is None and knee["saturated_at"] is None
    assert knee["reason"] == ("the service's backend became unavailable at step 2 (3 of 6 "
                              "requests: backend_unavailable 3): no knee drawn")
    # a service stopping (or not ready) is no backend of it: said as it is
    samples[3:] = [Sample(1, 3 + i, 3 + i, 3.01 + i, "http_503:shutting_down") for i in range(3)]
    second = summarize(samples, load=2, loop="closed", duration_s=6.0, cutoff=7.0)
    assert find_knee([first, second])["reason"] == (
        "the service became unable to search at step 2 (3 of 6 requests: shutting_down 3): "
        "no knee drawn")
    # an overloaded service's 503s are still refusals, and saturation
    samples[3:] = [Sample(1, 3 + i, 3 + i, 3.01 + i, "http_503:overloaded") for i in range(3)]
    second = summarize(samples, load=2, loop="closed", duration_s=6.0, cutoff=7.0)
    assert second["refused"] == 3 and second["unavailable"] == 0
    assert find_knee([first, second])["saturated_at"] == 2


def _es_questions(path: Path) -> Path:
    """A --queries file at `path` asking about the 3 documents the Elasticsearch tests index
    (`service_fixtures.CORPUS[:3]`)."""
    path.write_text("".join(json.dumps({"question": q}) + "\n" for q in (
        "When is the Harbor Festival?", "Who built the Old Lighthouse?",
        "What does the Alpha roadmap plan?")))
    return path


def _six_users_for_two_seconds(tmp_path: Path, limits) -> dict:
    """`branchsearch loadtest --users 6` for 2 s against `_service_over_es` with `limits`: the
    report it wrote (the run must exit 0)."""
    out = tmp_path / "lt.json"
    with _service_over_es(tmp_path, limits=limits) as (server, _):
        proc = _cli_loadtest(server.url, ["--users", "6", "--think", "0.05", "--duration", "2",
                                          "--report", str(out)], {}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@contextmanager
def _service_over_es(tmp_path: Path, limits=None, **settings):
    """`serve --standalone`'s app (dev mode: no key, one key's limits for every caller) over
    a 3-document index on Elasticsearch (the emulator), `settings` over the index's own, with
    `limits` (`admission.Limits`; the defaults without). Yields (the server, the emulator);
    both stopped after."""
    from es_emulator import start_es_emulator
    from service_fixtures import CORPUS, start_uvicorn, write_corpus

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.service import deploy as service

    es = start_es_emulator(tmp_path / "es")
    state = server = None
    try:
        settings = load_settings(overrides={"home": tmp_path / "home", "index": "es",
                                            "es_url": es.url, "search_mode": "bm25",
                                            "branches": 1, **settings}, read_env=False,
                                 read_file=False)
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]), settings, dense=False)
        state = service.local_state(settings, executor="local",
                                    **({"limits": limits} if limits else {}))
        state.searcher.target.drivers.open("es")
        server = start_uvicorn(service.create_app(state), state)
        yield server, es
    finally:
        if server is not None:
            server.stop()
            state.searcher.target.close()
        es.stop()


def _ramp_losing_its_backend(cli: list, env: dict, es, out) -> tuple[str, str, dict]:
    """Run `cli` on a closed-loop ramp 1:3:1 whose backend (`es`) is stopped once step 1 is
    said; it must exit 1. Returns (its stdout, its stderr, its JSON report at `out`)."""
    proc = subprocess.Popen(
        [*cli, "--loop", "closed", "--ramp", "1:3:1", "--step-duration", "2", "--think", "0.1",
         "--warmup", "0", "--drain", "30", "--report", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # a finished step is always its own line
        lines.append(line)
        if line.startswith("step 1:"):
            es.stop()  # the backend dies between the steps
            break
    stdout, rest = proc.communicate(timeout=240)
    stderr = "".join(lines) + rest
    assert lines and lines[-1].startswith("step 1:"), stderr[-3000:]
    assert proc.returncode == 1, (proc.returncode, stdout[-2000:], stderr[-3000:])
    return stdout, stderr, json.loads(out.read_text())


def test_cli_a_backend_dying_mid_ramp_is_no_knee_and_exits_1(tmp_path):
    """`serve --standalone`'s app over an index on Elasticsearch (the emulator), a closed-loop
    `loadtest --ramp` against it, the backend killed once the first step has ended: the
    service answered 503 backend_unavailable, the load test counted those as refusals and
    printed 'saturated at 2', exit 0. It now says the backend became unavailable at step 2,
    draws no knee, keeps the report and exits 1. Then, the backend still down: a new load
    test stops before any load, and Locust users' 503s get a row of their own."""
    proc = None
    with _service_over_es(tmp_path) as (server, es):
        try:
            queries = _es_questions(tmp_path / "q.jsonl")
            out = tmp_path / "lt.json"
            env = {k: v for k, v in os.environ.items() if k != "BRANCHSEARCH_API_KEY"}
            stdout, stderr, report = _ramp_losing_its_backend(
                [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--url",
                 server.url, "--queries", str(queries), "--home", str(tmp_path / "lt-home")],
                env, es, out)  # the service stays up
            first, second = report["steps"]  # the ramp stopped at the step that lost its backend
            assert first["ok"] == first["sent"] >= 1 and not first["errors"], first["errors"]
            assert second["unavailable"] >= 1 and second["refused"] == 0, second["errors"]
            assert set(second["unavailabilities"]) == {"http_503:backend_unavailable"}
            assert report["knee"]["knee"] is None and report["knee"]["saturated_at"] is None
            last = stderr.strip().splitlines()[-1]
            assert second["answered_after"] == "http_503:backend_unavailable", second
            assert last == (f"loadtest: the service's backend became unavailable at step 2 "
                            f"({second['unavailable']} of {second['sent']} requests: "
                            f"backend_unavailable {second['unavailable']}), and still did not "
                            "answer once the load stopped (http_503:backend_unavailable): no knee "
                            "drawn; the report keeps what was measured"), stderr[-2000:]
            assert "saturated" not in stdout and "saturated" not in (tmp_path / "lt.md").read_text()
            # a load test started while the backend is down: one line before any load, no report
            # (it ran a step of 503s and read 'already saturated at the first step', exit 0)
            again = subprocess.run(
                [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--url",
                 server.url, "--queries", str(queries), "--home", str(tmp_path / "lt-home"),
                 "--users", "1", "--duration", "5", "--warmup", "0", "--report",
                 str(tmp_path / "again.json")], env=env, capture_output=True, text=True,
                timeout=240)
            assert again.returncode == 2, (again.returncode, again.stdout[-2000:], again.stderr)
            line, = again.stderr.strip().splitlines()
            assert line.startswith(f"error: --url {server.url}: the first question got "
                                   "http_503:backend_unavailable (") and line.endswith(
                "): the service cannot search now (its backend or index is unavailable, or still "
                "starting), so no load was sent; run the load test once it answers"), line
            assert es.url.split("//")[1] not in line
            assert not (tmp_path / "again.json").exists() and not again.stdout
            # Locust users against the dead backend: their 503s in a row of their own (they were
            # in "/v1/search refused", with the overloaded service's)
            locust = subprocess.run(
                [sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"),
                 "--headless", "-u", "1", "-r", "1", "-t", "2s", "--stop-timeout", "30", "--host",
                 server.url, "--json"], env={**env, "BRANCHSEARCH_LOADTEST_QUERIES": str(queries)},
                capture_output=True, text=True, timeout=150)
            stats = json.loads(locust.stdout)
            assert {s["name"] for s in stats} == {"/v1/search unavailable"}, stats
            assert stats[0]["num_failures"] == stats[0]["num_requests"] >= 1
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_in_process_a_backend_dying_mid_ramp_is_no_knee_and_exits_1(tmp_path):
    """The in-process driver (no --url) over an index on Elasticsearch (the emulator), a
    closed-loop `loadtest --ramp`, the backend killed once the first step has ended: every
    search of the second step failed on its backend, counted as `failed` errors, and the run
    printed 'saturated at 2', exit 0. It now says the backend became unavailable at step 2,
    as the service target does, draws no knee, keeps the report and exits 1. Then, the
    backend still down: a new load test stops with one line before any load (opening the
    index finds it down)."""
    from es_emulator import start_es_emulator
    from service_fixtures import CORPUS, write_corpus

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.ingest.pipeline import ingest

    es = start_es_emulator(tmp_path / "es")
    proc = None
    try:
        home = tmp_path / "home"
        ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:3]),
               load_settings(overrides={"home": home, "index": "es", "es_url": es.url,
                                        "search_mode": "bm25", "branches": 1},
                             read_env=False, read_file=False), dense=False)
        queries = _es_questions(tmp_path / "q.jsonl")
        out = tmp_path / "lt.json"
        env = {**os.environ, "BRANCHSEARCH_ES_URL": es.url, "BRANCHSEARCH_SEARCH_MODE": "bm25"}
        cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--home",
               str(home), "--index", "es", "--queries", str(queries), "--executor", "local",
               "--branches", "1"]
        stdout, stderr, report = _ramp_losing_its_backend(cli, env, es, out)
        first, second = report["steps"]  # the ramp stopped at the step that lost its backend
        assert first["ok"] == first["sent"] >= 1 and not first["errors"], first["errors"]
        assert second["unavailable"] >= 1 and second["refused"] == 0, second["errors"]
        assert set(second["errors"]) <= set(second["unavailabilities"]), second["errors"]
        assert set(second["unavailabilities"]) <= {"unavailable:backend_unavailable",
                                                   "unavailable:search_failed"}, second
        assert report["knee"]["knee"] is None and report["knee"]["saturated_at"] is None
        codes = ", ".join(f"{k.split(':', 1)[1]} {n}"
                          for k, n in second["unavailabilities"].items())
        last = stderr.strip().splitlines()[-1]
        after = second["answered_after"]
        assert after in second["unavailabilities"], second
        assert last == (f"loadtest: the service's backend became unavailable at step 2 "
                        f"({second['unavailable']} of {second['sent']} requests: {codes}), and "
                        f"still did not answer once the load stopped ({after}): no knee drawn; "
                        "the report keeps what was measured"), stderr[-2000:]
        assert "saturated" not in stdout and "saturated" not in (tmp_path / "lt.md").read_text()
        # a load test started while the backend is down: one line before any load, no report
        again = subprocess.run(
            [*cli, "--users", "1", "--duration", "5", "--warmup", "0", "--report",
             str(tmp_path / "again.json")], env=env, capture_output=True, text=True,
            timeout=240)
        assert again.returncode == 2, (again.returncode, again.stdout[-2000:], again.stderr)
        line, = again.stderr.strip().splitlines()
        assert line.startswith("error: elasticsearch at ") and "is not reachable" in line, line
        assert not (tmp_path / "again.json").exists() and not again.stdout
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        es.stop()


def test_cli_a_backend_that_stalls_under_load_is_a_knee_and_one_that_dies_is_not(tmp_path):
    """`serve --standalone`'s app over an index on Elasticsearch (the emulator) whose requests
    time out after 0.3 s (`backend_timeout_s`), a closed-loop ramp against it; during step 2
    the emulator stalls for 2.5 s (SIGSTOP: alive, taking connections, answering nothing, as
    an Elasticsearch overwhelmed by the load or in a long GC pause), then answers again. The
    service answered 503 search_failed / backend_unavailable, exactly as for a dead backend,
    and the load test said 'the service's backend became unavailable … no knee drawn', exit
    1. A question asked once the step's load stopped is now answered, so the step reads as
    saturation: a knee at 1, the reason named, exit 0. (A backend that stays down still
    draws no knee: `test_cli_a_backend_dying_mid_ramp_is_no_knee_and_exits_1`.)"""
    import signal as sig

    proc = None
    with _service_over_es(tmp_path, backend_timeout_s=0.3, backend_retries=0) as (server, es):
        try:
            queries = _es_questions(tmp_path / "q.jsonl")
            out = tmp_path / "lt.json"
            env = {k: v for k, v in os.environ.items() if k != "BRANCHSEARCH_API_KEY"}
            proc = subprocess.Popen(
                [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--url",
                 server.url, "--queries", str(queries), "--home", str(tmp_path / "lt-home"),
                 "--loop", "closed", "--ramp", "1:3:1", "--step-duration", "4", "--think", "0.1",
                 "--warmup", "0", "--drain", "30", "--report", str(out)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if line.startswith("step 1:"):
                    time.sleep(0.3)  # step 2 under way
                    os.kill(es.pid, sig.SIGSTOP)
                    try:
                        time.sleep(2.5)
                    finally:
                        os.kill(es.pid, sig.SIGCONT)
                    break
            stdout, rest = proc.communicate(timeout=240)
            stderr = "".join(lines) + rest
            assert proc.returncode == 0, (proc.returncode, stdout[-2000:], stderr[-3000:])
            report = json.loads(out.read_text())
            first, second = report["steps"][:2]
            assert first["ok"] == first["sent"] >= 1 and not first["errors"], first["errors"]
            assert second["unavailable"] >= 1, second["errors"]
            assert set(second["unavailabilities"]) <= {"http_503:search_failed",
                                                       "http_503:backend_unavailable"}, second
            assert second["answered_after"] == "ok", second
            knee = report["knee"]
            assert (knee["knee"], knee["saturated_at"]) == (1, 2), knee
            assert knee["reason"].startswith("the backend could not keep up ("), knee
            assert "a question asked once the step's load stopped was answered" in knee["reason"]
            assert "no knee" not in stderr and "no knee" not in stdout, stderr[-2000:]
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if es.is_running():  # never leave it stopped: es.stop() would wait on it
                os.kill(es.pid, sig.SIGCONT)


def test_in_process_a_deadline_the_unloaded_driver_never_meets_is_one_error_before_any_load(
        hotpot_settings, tmp_path):
    """`loadtest` with no --url and `--deadline-s 0.001`: every search ended with its branches
    out of time, and the run read 'already saturated at the first step: errors 100.0% > 1%',
    exit 0, a report written. The first question, asked twice before any load as the HTTP
    target asks it, finds it: one line naming the flag, no load sent, no report; a deadline
    it meets runs."""
    from conftest import HOTPOT, ingest_copy

    settings = ingest_copy(hotpot_settings, "lt-deadline")
    out = tmp_path / "lt.json"
    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "loadtest", "--home",
           str(settings.home), "--index", "lt-deadline", "--queries", str(HOTPOT),
           "--executor", "local", "--branches", "1", "--users", "1", "--duration", "2",
           "--warmup", "0", "--report", str(out)]
    short = subprocess.run([*cli, "--deadline-s", "0.001"], capture_output=True, text=True,
                           timeout=300)
    assert short.returncode == 2, (short.returncode, short.stdout[-2000:], short.stderr)
    line, = short.stderr.strip().splitlines()
    assert line == ("error: --deadline-s 0.001: the first question, asked twice before any "
                    "load, had every branch out of time: the driver does not answer within it "
                    "even unloaded, so no load was sent; give a longer --deadline-s"), line
    assert not out.exists() and not short.stdout
    ok = subprocess.run([*cli, "--deadline-s", "60"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, (ok.stdout[-2000:], ok.stderr[-2000:])
    assert json.loads(out.read_text())["steps"][0]["ok"] >= 1


def test_the_question_after_a_step_waits_a_bounded_time_on_a_frozen_service(monkeypatch):
    """A step answered 503 backend_unavailable, then the service froze (it takes requests and
    answers nothing): the question asked after the step, up to three times, waited the whole
    client timeout each try (the service's own 60 s deadline, the HTTP timeout past it), so
    the run took minutes longer. Each try now carries a short deadline of its own (a few times
    the run's slowest answer, at least `AFTER_STEP_MIN_S`, never past one the user gave), and
    the client waits little past it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from branchsearch.orchestrator.loadtest import generator

    bodies, release = [], threading.Event()

    class Failing(BaseHTTPRequestHandler):  # two 503s (the step), then frozen
        def do_POST(self):  # noqa: N802 (http.server's name)
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) > 2:
                release.wait(60)
                return
            self.send_response(503)  # HTTP/1.0: the body ends with the connection
            self.end_headers()
            self.wfile.write(b'{"error": "backend_unavailable", "detail": "down"}')

        def log_message(self, *args):
            pass

    monkeypatch.setattr(generator, "AFTER_STEP_MIN_S", 0.5, raising=False)
    monkeypatch.setattr(generator, "AFTER_STEP_GAP_S", 0.1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for deadline_s, expected in ((None, 0.5), (0.2, 0.2)):  # one the user gave is kept
            bodies.clear()
            target = HttpTarget(url, timeout_s=30, deadline_s=deadline_s)
            out = []
            running = threading.Thread(target=lambda: out.append(_run(
                target, loads=(2.0,), process="constant", duration=1.0, drain_s=0.5)),
                daemon=True)
            running.start()
            running.join(20)
            assert not running.is_alive(), "the question after the step is still waiting"
            (result, wall), = out
            step, = result["steps"]
            assert step["unavailable"] == step["sent"] == 2, step
            assert step["answered_after"] == "error:Timeout" and len(bodies) == 5
            assert {b["deadline_s"] for b in bodies[2:]} == {expected}
            assert wall < 1.0 + 0.5 + 3 * (expected + 1.0) + 1.5, wall
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_a_backend_that_answers_once_the_load_stops_saturated_and_one_that_does_not_went_away():
    """By hand: a step of 503 search_failed whose backend answered a question once the load
    stopped (`answered_after` ok) read 'the service's backend became unavailable … no knee
    drawn' as a dead backend does; it is now the knee, the reason named. A backend still
    failing then draws no knee and says so; a service not ready or stopping is never load,
    whatever answered after."""
    first = summarize([Sample(0, i, i, i + 0.5, "ok") for i in range(6)], load=1,
                      loop="closed", duration_s=6.0, cutoff=7.0)
    samples = [Sample(1, i, i, i + 0.5, "ok") for i in range(3)]
    samples += [Sample(1, 3 + i, 3 + i, 3.3 + i, "http_503:search_failed") for i in range(3)]
    second = summarize(samples, load=2, loop="closed", duration_s=6.0, cutoff=7.0)
    knee = find_knee([first, {**second, "answered_after": "ok"}])
    assert (knee["knee"], knee["saturated_at"]) == (1, 2), knee
    assert knee["reason"] == ("the backend could not keep up (3 of 6 requests: search_failed "
                              "3), and a question asked once the step's load stopped was "
                              "answered")
    gone = find_knee([first, {**second, "answered_after": "http_503:backend_unavailable"}])
    assert gone == {"knee": None, "saturated_at": None, "reason": (
        "the service's backend became unavailable at step 2 (3 of 6 requests: search_failed "
        "3), and still did not answer once the load stopped (http_503:backend_unavailable): "
        "no knee drawn")}
    samples[3:] = [Sample(1, 3 + i, 3 + i, 3.01 + i, "http_503:shutting_down") for i in range(3)]
    stopping = summarize(samples, load=2, loop="closed", duration_s=6.0, cutoff=7.0)
    assert find_knee([first, {**stopping, "answered_after": "ok"}])["knee"] is None


def test_cli_503s_of_a_full_service_say_which_limit_from_their_fields(tmp_path):
    """`serve --standalone` with max_in_flight 1 and room for every key: 6 users, and the
    service refuses the requests past its one 503 `overloaded`. The report names the limit and
    its value, read from the 503's fields (`reason`, `limits`), as it does a key's 429s;
    before, a 503 said its limit only in prose and the report said nothing of it."""
    from branchsearch.orchestrator.service.admission import Limits

    report = _six_users_for_two_seconds(tmp_path, Limits(per_key_concurrency=8,
                                                         per_key_queue=0, max_in_flight=1))
    assert report["steps"][0]["refusals"].get("http_503:overloaded"), report["steps"]
    refused = [n for n in report["notes"] if "503" in n]
    assert len(refused) == 1 and re.fullmatch(
        r"the service's requests in flight reached its max_in_flight \(max_in_flight 1\): \d+ "
        r"requests? (?:was|were) refused at once \(503 overloaded\), and refusals count as "
        r"errors: past that this measures the service's admission limit, not its search; raise the "
        r"service's max_in_flight, or add instances", refused[0]), report["notes"]
