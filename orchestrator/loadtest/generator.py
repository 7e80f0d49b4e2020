"""The load generator: runs steps of open- or closed-loop load against a target, each bounded in
time, and collects one `Sample` per request.

Open loop: the send times of a step are drawn before it starts (`arrivals.schedule`); each send
starts its own thread at its time, whatever is still running, so slow answers never delay later
arrivals, and latency counts from the scheduled time. Past `max_inflight` running requests a new
arrival is recorded as `dropped` (an error) rather than queued in the client. Closed loop: `users`
threads ask, wait for the answer, think, ask again. After a step's sending window the generator
waits at most `drain_s` for running requests; what is still running then is `unfinished`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from branchsearch.orchestrator.loadtest.arrivals import Step, schedule
from branchsearch.orchestrator.loadtest.stats import DROPPED, OK, Sample, find_knee, \
    backend_failed, is_refusal, is_unserved, not_load, slo_broken_at, slo_max, summarize, \
    unreachable
from branchsearch.orchestrator.loadtest.targets import RequestFailed, Target, classify
from branchsearch.orchestrator.loadtest.workload import Workload
from branchsearch.orchestrator.evaluation.measures import percentile

# closed loop: a user refused, or that reached no service, waits this long when the answer
# carried no `Retry-After` (with one, it waits what that asks, at most `MAX_BACK_OFF_S`)
BACKOFF_S = 0.5
# a step in which the target could not search: questions asked one by one after it, this far
# apart, before it counts as gone (a backend that only fell behind the load catches up)
AFTER_STEP_TRIES, AFTER_STEP_GAP_S = 3, 1.0
# each of those questions carries a deadline of its own: this many times the slowest answer of
# the run so far, at least AFTER_STEP_MIN_S, so a frozen backend costs seconds, not the service's
# whole deadline per try (an HTTP client waits `targets.DEADLINE_GRACE_S` past it); at most the
# service's default deadline, which every service accepts unless its operator lowered it
AFTER_STEP_FACTOR, AFTER_STEP_MIN_S, AFTER_STEP_MAX_S = 3.0, 5.0, 60.0


@dataclass(frozen=True)
class LoadSpec:
    loop: str  # open | closed
    steps: tuple[Step, ...]
    process: str = "poisson"  # open loop: poisson | constant
    drain_s: float = 10.0
    max_inflight: int = 256
    think_s: float = 0.0  # closed loop: pause between a user's answer and its next question
    seed: int = 0
    warmup: int = 2  # requests sent one by one before the first step, not measured
    stop_at_knee: bool = True
    slo_p99_ms: float | None = None
    not_reached: str = "raise the ramp's STOP"  # what to do when no step saturated


def ask(target: Target, question: str, deadline_s: float | None = None) -> dict:
    """The sample fields of one request (never raises); with `deadline_s`, the request's own
    deadline (the target keeps a shorter one it was given). A failure whose answer carried a
    `Retry-After` adds `retry_after_s` (not a sample field: `pause_after` takes it out)."""
    try:
        return classify(target.search(question) if deadline_s is None
                        else target.search(question, deadline_s=deadline_s))
    except RequestFailed as exc:
        return {"outcome": exc.outcome, **({"retry_after_s": exc.retry_after_s}
                                           if exc.retry_after_s is not None else {})}
    except Exception as exc:  # a target bug must not stop the generator
        return {"outcome": f"error:{type(exc).__name__}"}


def pause_after(fields: dict, think_s: float) -> float:
    """How long a closed-loop user waits before its next question, taking `retry_after_s` out
    of `fields`: `think_s` after an answer; after a request no service took on, the
    `Retry-After` its answer asked for, or `BACKOFF_S` without one — `think_s` when that is
    longer. A refused user asks again as a client honouring the service does (and as the
    locustfile's users do), not thousands of times a second at a full or dead service."""
    retry_after = fields.pop("retry_after_s", None)
    if not is_unserved(fields["outcome"]):
        return think_s
    return max(think_s, BACKOFF_S if retry_after is None else retry_after)


def _outside(fields: dict, sent: float) -> dict:
    """Add `outside_server`: the client's wait beyond the driver's own time (HTTP, the
    service's queue and limits; in-process, next to nothing)."""
    stages = fields.get("stages")
    if stages and "server" in stages:
        stages["outside_server"] = max(time.monotonic() - sent - stages["server"], 0.0)
    return fields


class _Step:
    """Shared state of the step that is running (the progress line reads it)."""

    def __init__(self, index: int, load: float, loop: str):
        self.index, self.load, self.loop = index, load, loop
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.inflight = 0
        self.started = time.monotonic()

    def finish(self, sample: Sample, fields: dict, done: float) -> None:
        with self.lock:
            for key, value in fields.items():
                setattr(sample, key, value)
            sample.done = done
            self.inflight -= 1
            self.idle.notify_all()

    def drain(self, timeout_s: float) -> tuple[list[Sample], float]:
        """Wait for running requests (at most timeout_s); a snapshot and the cutoff time."""
        with self.lock:
            self.idle.wait_for(lambda: self.inflight == 0, timeout=max(timeout_s, 0))
            return [copy.copy(s) for s in self.samples], time.monotonic()

    def progress(self, n_steps: int) -> str:
        with self.lock:
            samples = list(self.samples)
            inflight = self.inflight
        done = [s for s in samples if s.done is not None]
        lat = [s.done - s.scheduled for s in done if not is_unserved(s.outcome)]
        errors = sum(s.outcome != OK for s in done) + sum(s.outcome == DROPPED for s in samples)
        refused = sum(is_refusal(s.outcome) for s in done)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        load = f"{self.load:g}/s" if self.loop == "open" else f"{self.load:g} users"
        p = (f"p50 {percentile(lat, 50) * 1000:.0f} ms p99 {percentile(lat, 99) * 1000:.0f} ms"
             if lat else "p50 - p99 -")
        return (f"step {self.index + 1}/{n_steps} {load} {elapsed:4.0f}s | sent {len(samples)} "
                f"done {len(done)} in flight {inflight} | {len(done) / elapsed:.2f}/s | {p} | "
                f"errors {errors}" + (f" (refused {refused})" if refused else ""))


class Generator:
    def __init__(self, target: Target, workload: Workload, spec: LoadSpec,
                 probe: Callable[[], object] | None = None,
                 progress: Callable[[str], None] | None = None, progress_every_s: float = 1.0):
        self.target, self.workload, self.spec = target, workload, spec
        self.probe = probe  # () -> context manager with .result() (probes.StepProbe)
        self.progress, self.progress_every_s = progress, progress_every_s
        self._asked = 0
        self._asked_lock = threading.Lock()
        self._stop = threading.Event()
        self._current: _Step | None = None
        self._slowest_s = 0.0  # the slowest answer of the steps so far

    def _next_question(self) -> str:
        with self._asked_lock:
            i, self._asked = self._asked, self._asked + 1
        return self.workload.question(i)

    # --- one step -----------------------------------------------------------------------------

    def _open(self, step: _Step, rate: float, duration_s: float) -> None:
        offsets = schedule(self.spec.process, rate, duration_s, seed=self.spec.seed + step.index)
        start = time.monotonic() + 0.02
        step.started = start

        def send(sample: Sample, question: str) -> None:
            sample.sent = time.monotonic()
            fields = ask(self.target, question)
            fields.pop("retry_after_s", None)  # arrivals keep their schedule
            step.finish(sample, _outside(fields, sample.sent), time.monotonic())

        for offset in offsets:
            at = start + offset
            if self._stop.wait(max(at - time.monotonic(), 0)):
                return
            sample = Sample(step.index, at)
            with step.lock:
                step.samples.append(sample)
                if step.inflight >= self.spec.max_inflight:
                    sample.outcome = DROPPED
                    continue
                step.inflight += 1
            threading.Thread(target=send, args=(sample, self._next_question()), daemon=True,
                             name="loadtest-request").start()
        self._stop.wait(max(start + duration_s - time.monotonic(), 0))

    def _closed(self, step: _Step, users: int, duration_s: float) -> None:
        step.started = time.monotonic()
        end = step.started + duration_s

        def user() -> None:
            while not self._stop.is_set() and time.monotonic() < end:
                sample = Sample(step.index, time.monotonic())
                sample.sent = sample.scheduled
                with step.lock:
                    step.samples.append(sample)
                    step.inflight += 1
                fields = ask(self.target, self._next_question())
                pause = pause_after(fields, self.spec.think_s)
                step.finish(sample, _outside(fields, sample.sent), time.monotonic())
                if pause and self._stop.wait(pause):
                    return

        for _ in range(users):
            threading.Thread(target=user, daemon=True, name="loadtest-user").start()
        self._stop.wait(max(end - time.monotonic(), 0))

    def run_step(self, index: int, step: Step) -> dict:
        state = _Step(index, step.load, self.spec.loop)
        self._current = state
        probe = self.probe() if self.probe else None
        with probe or contextlib.nullcontext():
            if self.spec.loop == "open":
                self._open(state, step.load, step.duration_s)
            else:
                self._closed(state, int(step.load), step.duration_s)
            samples, cutoff = state.drain(self.spec.drain_s)
        summary = summarize(samples, load=step.load, loop=self.spec.loop,
                            duration_s=step.duration_s, cutoff=cutoff)
        summary["step"] = index
        summary["wall_s"] = round(cutoff - state.started, 3)
        summary["latencies_ms"] = sorted(  # as the percentiles: no drops, nothing unserved
            round(s.latency(cutoff) * 1000, 1) for s in samples
            if s.outcome != DROPPED and not is_unserved(s.outcome))
        if probe:
            summary["probes"] = probe.result()
        self._slowest_s = max([self._slowest_s, *(s.done - s.scheduled for s in samples
                                                  if s.outcome == OK and s.done is not None)])
        if summary["unavailable"] and backend_failed(summary) and not unreachable(summary):
            summary["answered_after"] = self._answered_after(self._slowest_s)
        return summary

    def _answered_after(self, slowest_s: float) -> str:
        """The outcome of a question asked once a step's load has stopped (`ok`, or the last
        failure of `AFTER_STEP_TRIES`): a step whose target said it cannot search (a 503
        `search_failed`, `backend_unavailable`: its backend timed out or failed) saturated
        when the target answers again unloaded, and lost its backend when it does not. A
        backend that is alive but slower than its timeout under the load yields the same codes
        as one that is down; only asking again without the load tells them apart. Each try has
        a deadline of `AFTER_STEP_FACTOR` times `slowest_s` (the slowest answer measured so
        far), at least `AFTER_STEP_MIN_S` and at most `AFTER_STEP_MAX_S`: a backend that does
        not answer unloaded within a few times what it took under load has not just fallen
        behind."""
        deadline_s = min(max(AFTER_STEP_FACTOR * slowest_s, AFTER_STEP_MIN_S), AFTER_STEP_MAX_S)
        outcome = ""
        for attempt in range(AFTER_STEP_TRIES):
            if attempt and self._stop.wait(AFTER_STEP_GAP_S):
                break
            outcome = ask(self.target, self._next_question(), deadline_s)["outcome"]
            if outcome == OK:
                break
        return outcome

    def _partial(self, state: _Step) -> dict:
        """The step under way at a ^C, as far as it got: its requests answered by now, its
        running ones unfinished, its rate over the time it ran."""
        self._stop.set()
        samples, cutoff = state.drain(0)
        ran = max(cutoff - state.started, 1e-3)
        summary = summarize(samples, load=state.load, loop=self.spec.loop, duration_s=ran,
                            cutoff=cutoff)
        summary.update(step=state.index, wall_s=round(ran, 3), partial=True,
                       latencies_ms=sorted(round(s.latency(cutoff) * 1000, 1) for s in samples
                                           if s.outcome != DROPPED
                                           and not is_unserved(s.outcome)))
        return summary

    # --- the whole run ------------------------------------------------------------------------

    def _ticker(self, n_steps: int) -> None:
        while not self._stop.wait(self.progress_every_s):
            if self._current is not None and self.progress:
                self.progress(self._current.progress(n_steps))

    def run(self) -> dict:
        for _ in range(self.spec.warmup):
            ask(self.target, self._next_question())
        steps: list[dict] = []
        stopped, interrupted = "", False
        ticker = None
        if self.progress:
            ticker = threading.Thread(target=self._ticker, args=(len(self.spec.steps),),
                                      daemon=True, name="loadtest-progress")
            ticker.start()
        try:
            for i, step in enumerate(self.spec.steps):
                steps.append(self.run_step(i, step))
                if self.progress:
                    self.progress(step_line(steps[-1]) + "\n")
                knee = find_knee(steps)
                slo_broken = self.spec.slo_p99_ms is None or slo_max(
                    steps[-1:], self.spec.slo_p99_ms) is None
                if (why := not_load(steps[-1], i + 1)) and i + 1 < len(self.spec.steps):
                    stopped = f"stopped after step {i + 1}: {why}"
                    break
                if self.spec.stop_at_knee and knee["saturated_at"] is not None and slo_broken \
                        and i + 1 < len(self.spec.steps):
                    stopped = (f"stopped after step {i + 1}: past the knee"
                               + (" and the SLO" if self.spec.slo_p99_ms else ""))
                    break
        except KeyboardInterrupt:  # what the step under way measured so far is kept
            interrupted = True
            current = self._current
            if current is not None and len(steps) <= current.index:
                steps.append(self._partial(current))
        finally:
            self._stop.set()
            if ticker:
                ticker.join(timeout=2)
        not_reached = "interrupted before the last step" if interrupted \
            else self.spec.not_reached
        out = {"steps": steps, "knee": find_knee(steps, not_reached), "stopped": stopped,
               "interrupted": interrupted}
        if self.spec.slo_p99_ms is not None:
            out["slo"] = {"p99_ms": self.spec.slo_p99_ms, "max_error_rate": 0.01,
                          "holds_up_to": slo_max(steps, self.spec.slo_p99_ms),
                          "broken_at": slo_broken_at(steps, self.spec.slo_p99_ms)}
        return out


def step_line(s: dict) -> str:
    """One finished step as a line."""
    load = (f"offered {s['offered_rate']:.3g}/s" if s["loop"] == "open"
            else f"{s['users']} users")
    lat = s["latency_ms"]
    p = (f"p50 {lat['p50']:.0f} p90 {lat['p90']:.0f} p99 {lat['p99']:.0f} max {lat['max']:.0f} ms"
         if lat["p50"] is not None else "no answers")
    refused = (f", refused {s['refused']} ({s['refusal_rate']:.1%}, not in the percentiles)"
               if s.get("refused") else "")
    return (f"step {s['step'] + 1}: {load}, achieved {s['achieved_rate']:.3g}/s, {p}, "
            f"errors {s['error_rate']:.1%} "
            + ", ".join(f"{k} {v}" for k, v in s["errors"].items())).rstrip() + refused
