"""What one load step measured, and where a ramp saturates. Pure functions over `Sample`s.

Latency is client-side and counted from the *scheduled* send time (open loop) or the send time
(closed loop), so a request that waited behind a slow one still shows its wait. A request still
running when the step's drain ends is `unfinished`: it counts as an error and enters the latency
percentiles at its lower bound (`latency_lower_bound` says so). A request the generator refused
because `max_inflight` requests were already running is `dropped`: an error, with no latency.

A request the service refused — HTTP 429 (a key over its concurrency limit) or 503 `overloaded`
(or a 503 without a code of ours: a proxy's "not now, retry") — is `refused`: an error, counted
apart (`refused`, `refusal_rate`, `refusals` by class) and kept out of the latency percentiles,
which describe the requests the service took on. A fast refusal mixed into them would make an
overloaded service look quick; their own timing is `refusal_latency_ms`. So is a request that
never reached a service (connection refused or broken: `unreached`): a dead service answers
nothing, fast. So is a 503 whose code says the service cannot search now (`unavailable`: its
backend down or timing out, its index not started, the service not ready or stopping). A
backend alive but slower than its timeout under the load answers `search_failed` or
`backend_unavailable` as a dead one does, so after such a step one question is asked without
the load (`answered_after`): answered, the backend could not keep up, which is saturation (the
reason names it); not answered, part of the deployment went away, and no knee is drawn from the
step. And so is a request the service `rejected` as one it will never answer (any other
4xx: a key it does not know, a question it cannot search, an index it does not have): neither
a measure of load nor a sign of saturation, so no knee is drawn from a step that has one.

Achieved rate is ok answers per second (`completion_rate`): open loop, over the step stretched
by how much longer its completions took to come out than its requests took to go in — equal to
the offered rate when the system keeps up, however the arrivals bunch, and to its capacity when
it does not, without the start/end bias of counting completions inside the send window (a bias
of latency/duration, which for multi-second searches would look like saturation), and never
above the offered rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from branchsearch.orchestrator.evaluation.measures import percentile

OK = "ok"
DROPPED = "dropped"
UNFINISHED = "unfinished"
REFUSAL_STATUSES = ("http_429", "http_503")
# 503 codes (orchestrator/service) that say the service cannot search now, load or no load: a
# backend that does not answer, every branch failed on its backend, the index still starting or
# changed on disk, the service not ready, stopping, or its searcher replica restarting, and
# what only its operator can fix. `overloaded` alone (a queue or in-flight limit) says "busy".
UNAVAILABLE_CODES = frozenset({
    "backend_unavailable", "search_failed", "not_ready", "index_starting", "index_changed",
    "searcher_unavailable", "shutting_down", "index_incomplete", "index_misconfigured",
    "index_not_writable", "keys_unavailable"})
BACKEND_CODES = frozenset({"backend_unavailable", "search_failed"})  # of those, its backend's
# the in-process driver's outcome of a search it could not make, with the code the service
# would answer it with: `unavailable:backend_unavailable` (`targets.DriverTarget`)
UNAVAILABLE = "unavailable"
# the request never reached a service: nothing answered, or the connection broke under it
UNREACHED = {f"error:{name}" for name in (
    "ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError",
    "RemoteDisconnected", "BrokenPipeError", "gaierror")}


def error_code(outcome: str) -> str:
    """The service's error code of an outcome (`http_503:overloaded` -> `overloaded`, and the
    in-process driver's `unavailable:backend_unavailable` -> `backend_unavailable`; '' when it
    carries none)."""
    status, _, code = outcome.partition(":")
    return code if status.startswith("http_") or status == UNAVAILABLE else ""


def is_unavailable(outcome: str) -> bool:
    """The target cannot search now, whatever the load: the service answered a 503 whose code
    is one of `UNAVAILABLE_CODES` (`backend_unavailable`, `not_ready`, …), or the driver in
    this process met what the service answers so (`unavailable:<code>`). Its backend or index
    went away; the deployment did not saturate."""
    return (outcome.split(":", 1)[0] in ("http_503", UNAVAILABLE)
            and error_code(outcome) in UNAVAILABLE_CODES)


def is_refusal(outcome: str) -> bool:
    """The service declined the request for now: a 429, or a 503 `overloaded` (or without a
    code of ours). A 503 that says it cannot search at all is `is_unavailable`, not this."""
    return outcome.split(":", 1)[0] in REFUSAL_STATUSES and not is_unavailable(outcome)


def is_rejected(outcome: str) -> bool:
    """The service turned the request down for good: a 4xx other than 429 (401 a key it does
    not know, 404 an index it does not have, 422 a question it cannot search). Load has no
    part in it: the key, the workload or the URL is wrong."""
    status = outcome.split(":", 1)[0]
    return status.startswith("http_4") and status not in REFUSAL_STATUSES


def is_unserved(outcome: str) -> bool:
    """No service took the request on: refused (429/503 overloaded), unavailable (a 503 that
    says it cannot search), rejected (another 4xx), or never reached (a connection refused or
    broken: the service is down). Errors, kept out of the latency percentiles: milliseconds of
    "connection refused" or "unknown API key" would make the service look fast."""
    return (is_refusal(outcome) or is_unavailable(outcome) or is_rejected(outcome)
            or outcome in UNREACHED)


@dataclass
class Sample:
    step: int
    scheduled: float  # monotonic seconds: when it should have been sent
    sent: float = 0.0  # when it was sent
    done: float | None = None  # when the answer (or error) came back; None: unfinished
    outcome: str = UNFINISHED  # ok | partial | failed | http_<code> | error:<Class> | dropped
    stages: dict = field(default_factory=dict)  # server-side seconds per stage
    tokens_read: int = 0
    branch_status: dict = field(default_factory=dict)  # non-ok branch statuses -> count

    def latency(self, cutoff: float) -> float:
        """Seconds from the scheduled send to the answer (or to `cutoff` if unfinished)."""
        return (self.done if self.done is not None else cutoff) - self.scheduled


def _pcts(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    return {"p50": round(percentile(values, 50) * scale, 2),
            "p90": round(percentile(values, 90) * scale, 2),
            "p99": round(percentile(values, 99) * scale, 2),
            "max": round(max(values) * scale, 2),
            "mean": round(sum(values) / len(values) * scale, 2)}


def completion_rate(done_times: list[float], sent_times: list[float] | None,
                    window_s: float) -> float:
    """Completions per second.

    Open loop (`sent_times`: when the same requests were scheduled): n / (window + the span of
    the completions less the span of the sends). While the target keeps up its completions are
    the arrivals shifted by their latency, and this is n / window, the offered rate — however
    a few Poisson arrivals bunch within the step; when it does not, the completions come out
    at its capacity and take that much longer. Closed loop (no sends
    given): (n - 1) / span. Fewer than two completions, or no span: n / window_s."""
    n = len(done_times)
    span = max(done_times) - min(done_times) if n else 0.0
    if sent_times is not None and n:
        stretched = window_s + span - (max(sent_times) - min(sent_times))
        return n / stretched if stretched > 0 else n / window_s
    if n >= 2 and span > 0:
        return (n - 1) / span
    return n / window_s if window_s > 0 else 0.0


def summarize(samples: list[Sample], *, load: float, loop: str, duration_s: float,
              cutoff: float) -> dict:
    """One step's figures. `loop` is `open` (load = offered rate/s) or `closed` (load = users);
    `cutoff` is when the step's drain ended (the lower bound for unfinished requests)."""
    answered = [s for s in samples if s.outcome != DROPPED]
    refused = [s for s in answered if is_refusal(s.outcome)]
    rejected = [s for s in answered if is_rejected(s.outcome)]
    unavailable = [s for s in answered if is_unavailable(s.outcome)]
    served = [s for s in answered if not is_unserved(s.outcome)]  # the latency percentiles'
    unreached = [s for s in answered if s.outcome in UNREACHED]
    done = [s for s in answered if s.done is not None]
    ok = [s for s in done if s.outcome == OK]
    if len(done) < len(answered) and samples:
        # requests still running at the cutoff: the target was busy all along and finished
        # only these (the span of the few completions would overstate its rate)
        throughput = len(done) / (cutoff - min(s.scheduled for s in samples))
    else:
        throughput = completion_rate([s.done for s in done], [s.scheduled for s in done]
                                     if loop == "open" else None, duration_s)
    if loop == "open" and samples:  # never more answers a second than requests were sent:
        # the span of a few completions is short when Poisson arrivals bunch or the first
        # answer is the slowest (1.03/s achieved of 0.85/s offered)
        throughput = min(throughput, len(samples) / duration_s)
    achieved = throughput * len(ok) / len(done) if done else 0.0
    span = (max(s.done for s in done) - min(s.scheduled for s in samples)) if done else 0.0
    errors = Counter(s.outcome for s in samples if s.outcome != OK)
    branch_errors: Counter = Counter()
    for s in samples:
        branch_errors.update(s.branch_status)
    stage_names = sorted({k for s in done for k in s.stages})
    stages = {name: _pcts([s.stages[name] for s in done if name in s.stages])
              for name in stage_names}
    return {
        "load": load, "loop": loop, "duration_s": duration_s,
        "offered_rate": round(len(samples) / duration_s, 4) if loop == "open" else None,
        "users": int(load) if loop == "closed" else None,
        "sent": len(samples), "completed": len(done), "ok": len(ok),
        "throughput_rate": round(throughput, 4), "achieved_rate": round(achieved, 4),
        "error_rate": round(sum(errors.values()) / len(samples), 4) if samples else 0.0,
        "errors": dict(sorted(errors.items())),
        "refused": len(refused),
        "refusal_rate": round(len(refused) / len(samples), 4) if samples else 0.0,
        "refusals": dict(sorted(Counter(s.outcome for s in refused).items())),
        "rejected": len(rejected),
        "rejections": dict(sorted(Counter(s.outcome for s in rejected).items())),
        "unavailable": len(unavailable),
        "unavailabilities": dict(sorted(Counter(s.outcome for s in unavailable).items())),
        "unreached": len(unreached),
        "ended_unreached": ended_unreached(answered),
        "branch_errors": dict(sorted(branch_errors.items())),
        "latency_ms": _pcts([s.latency(cutoff) for s in served]),
        "latency_lower_bound": any(s.done is None for s in served),
        "refusal_latency_ms": _pcts([s.latency(cutoff) for s in refused]),
        "send_lag_ms": _pcts([s.sent - s.scheduled for s in answered if s.sent]),
        "stages_ms": stages,
        "tokens_read_per_s": round(sum(s.tokens_read for s in done) / span, 1) if span > 0
        else 0.0,
    }


def saturated(step: dict, previous: dict | None, baseline: dict, *, tolerance: float = 0.1,
              latency_factor: float = 3.0, max_error: float = 0.01) -> str:
    """Why a step is past the knee ('' if it is not).

    Open loop: the achieved rate falls more than `tolerance` below the offered rate, errors pass
    `max_error`, or the median latency grows past `latency_factor` x the first step's: queueing
    delays every request, the median with them, while one slow request (a hard question, a
    neighbour on a shared core) moves only a step's p99, which is its slowest request or two
    at a few dozen requests a step. The tail is the SLO's to judge (`slo_problem`). Closed loop (no
    offered rate): adding users adds less than half the throughput linear scaling would, or
    errors."""
    if fell_behind(step):
        return (f"the backend could not keep up ({_unavailable_counts(step)}), and a question "
                "asked once the step's load stopped was answered")
    if step["error_rate"] > max_error:
        return f"errors {step['error_rate']:.1%} > {max_error:.0%}"
    if step["loop"] == "open":
        if step["achieved_rate"] < (1 - tolerance) * step["offered_rate"]:
            return (f"achieved {step['achieved_rate']:.3g}/s < {1 - tolerance:.0%} of offered "
                    f"{step['offered_rate']:.3g}/s")
        base, p50 = baseline["latency_ms"]["p50"], step["latency_ms"]["p50"]
        if base and p50 is not None and p50 > latency_factor * base:
            return f"p50 {p50:.0f} ms > {latency_factor:g} x the first step's {base:.0f} ms"
        return ""
    if previous is not None and previous["throughput_rate"] > 0:
        linear_gain = step["load"] / previous["load"] - 1
        gain = step["throughput_rate"] / previous["throughput_rate"] - 1
        if linear_gain > 0 and gain < 0.5 * linear_gain:
            return (f"throughput +{gain:.0%} for +{linear_gain:.0%} users (< half of linear)")
    return ""


def ended_unreached(samples: list[Sample]) -> bool:
    """Whether the last request sent reached no service: the service went away during the
    step and did not come back before it ended (a loaded service answers, if only 429/503)."""
    last = max(samples, key=lambda s: s.sent or s.scheduled, default=None)
    return last is not None and last.outcome in UNREACHED


def unreachable(step: dict) -> bool:
    """Whether the service went away during a step, which says nothing of where it saturates:
    most of its requests reached no service (refused connections, resets), or its last one
    did (a service that died partway through)."""
    return (step.get("unreached", 0) * 2 > max(step.get("sent", 0), 1)
            or bool(step.get("ended_unreached")))


def not_load(step: dict, number: int) -> str:
    """Why a step (the `number`th) says nothing of where the target saturates ('' when it
    does): the service became unreachable, it answered that it cannot search (its backend or
    index went away: a 503 `backend_unavailable`, `not_ready`, …), it rejected requests (its
    errors are the key's, the workload's or the URL's, not the load's), or the step sent
    nothing."""
    if unreachable(step):
        return (f"the service became unreachable at step {number} ({step['unreached']} of "
                f"{step['sent']} requests reached no service"
                + (", the last one among them" if step.get("ended_unreached") else "")
                + "): no knee drawn")
    if step.get("unavailable") and not fell_behind(step):
        codes = {error_code(k): v for k, v in step["unavailabilities"].items()}
        what = ("the service's backend became unavailable" if set(codes) <= BACKEND_CODES
                else "the service became unable to search")  # not ready, stopping, …
        still = (f", and still did not answer once the load stopped "
                 f"({step['answered_after']})" if step.get("answered_after") else "")
        return f"{what} at step {number} ({_unavailable_counts(step)}){still}: no knee drawn"
    if step.get("rejected"):
        kinds = ", ".join(f"{k} {v}" for k, v in step["rejections"].items())
        return (f"the service rejected {step['rejected']} of {step['sent']} requests at step "
                f"{number} ({kinds}): a key, question or URL it refuses, not load; no knee "
                "drawn")
    if not step.get("sent"):
        return f"step {number} sent no request: it measured nothing; no knee drawn"
    return ""


def backend_failed(step: dict) -> bool:
    """Whether a step's 503s saying the service cannot search are all its backend's
    (`search_failed`, `backend_unavailable`): the codes of a backend down, and of one alive but
    slower than its timeout under the load. Others (`not_ready`, `index_starting`,
    `shutting_down`, …) are the service's own state, never the load's."""
    codes = {error_code(k) for k in step.get("unavailabilities", {})}
    return bool(codes) and codes <= BACKEND_CODES


def fell_behind(step: dict) -> bool:
    """Whether a step's backend failed under the load and answered once it stopped
    (`answered_after`): it could not keep up, which is saturation, not an outage."""
    return bool(step.get("unavailable")) and backend_failed(step) \
        and step.get("answered_after") == OK


def _unavailable_counts(step: dict) -> str:
    """"4 of 32 requests: search_failed 3, backend_unavailable 1"."""
    kinds = ", ".join(f"{error_code(k)} {n}" for k, n in step["unavailabilities"].items())
    return f"{step['unavailable']} of {step['sent']} requests: {kinds}"


def find_knee(steps: list[dict], not_reached: str = "raise the ramp's STOP",
              **criteria) -> dict:
    """The last step before the first saturated one. Returns {knee, saturated_at, reason}: knee
    is None when the first step already saturates or no step does (then `reason` says which),
    and when a step before either says nothing of saturation (`not_load`: the service
    became unreachable or unable to search, rejected requests, or the step sent none)."""
    for i, step in enumerate(steps):
        if why := not_load(step, i + 1):
            return {"knee": None, "saturated_at": None, "reason": why}
        why = saturated(step, steps[i - 1] if i else None, steps[0], **criteria)
        if why:
            return {"knee": steps[i - 1]["load"] if i else None, "saturated_at": step["load"],
                    "reason": why if i else f"already saturated at the first step: {why}"}
    top = steps[-1]["load"] if steps else None
    return {"knee": None, "saturated_at": None,
            "reason": f"not reached up to {top:g}: {not_reached}" if steps
            else "no steps"}


def slo_problem(step: dict, p99_ms: float, *, max_error: float = 0.01,
                tolerance: float = 0.1) -> str:
    """Why `step` breaks the SLO ('' if it holds): p99 over `p99_ms`, errors over
    `max_error`, or (open loop) achieved below (1 - tolerance) x offered."""
    p99 = step["latency_ms"]["p99"]
    if p99 is None:
        return "no request was answered"
    if p99 > p99_ms:
        return f"p99 {p99:.0f} ms > {p99_ms:g} ms"
    if step["error_rate"] > max_error:
        return f"errors {step['error_rate']:.1%} > {max_error:.0%}"
    if step["loop"] == "open" and step["achieved_rate"] < (1 - tolerance) * step["offered_rate"]:
        return (f"achieved {step['achieved_rate']:.3g}/s < {1 - tolerance:.0%} of offered "
                f"{step['offered_rate']:.3g}/s")
    return ""


def slo_max(steps: list[dict], p99_ms: float, *, max_error: float = 0.01,
            tolerance: float = 0.1) -> dict | None:
    """The highest load such that it and every lower step held p99 <= p99_ms, errors <=
    max_error and (open loop) achieved >= (1 - tolerance) x offered; None if the first fails."""
    best = None
    for step in sorted(steps, key=lambda s: s["load"]):
        if slo_problem(step, p99_ms, max_error=max_error, tolerance=tolerance):
            break
        best = step
    if best is None:
        return None
    return {"load": best["load"], "offered_rate": best["offered_rate"],
            "achieved_rate": best["achieved_rate"], "p99_ms": best["latency_ms"]["p99"],
            "error_rate": best["error_rate"]}


def slo_broken_at(steps: list[dict], p99_ms: float, **criteria) -> dict | None:
    """The lowest step that broke the SLO, and why ({load, reason}); None if every one held."""
    for step in sorted(steps, key=lambda s: s["load"]):
        why = slo_problem(step, p99_ms, **criteria)
        if why:
            return {"load": step["load"], "reason": why}
    return None
