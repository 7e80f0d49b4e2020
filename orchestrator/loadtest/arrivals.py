"""When requests are sent: open-loop schedules and the load steps of a ramp. Pure functions.

Open loop: send times are fixed in advance from the rate alone, so a slow response never delays
the next request (no coordinated omission); latency is measured from the scheduled time.
Closed loop: `users` clients each send, wait for the answer, then send again.
"""

from __future__ import annotations

import math

import random
from dataclasses import dataclass

from branchsearch.infra.errors import BranchsearchError

PROCESSES = ("poisson", "constant")


def poisson_schedule(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds from the step start) of a Poisson process of `rate` per second:
    exponential gaps, every offset < duration_s."""
    if rate <= 0 or duration_s <= 0:
        return []
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def constant_schedule(rate: float, duration_s: float) -> list[float]:
    """One send every 1/rate seconds, the first at 0."""
    if rate <= 0 or duration_s <= 0:
        return []
    n = int(duration_s * rate - 1e-9) + 1
    return [i / rate for i in range(n) if i / rate < duration_s]


def schedule(process: str, rate: float, duration_s: float, seed: int = 0) -> list[float]:
    if process == "poisson":
        return poisson_schedule(rate, duration_s, random.Random(seed))
    if process == "constant":
        return constant_schedule(rate, duration_s)
    raise BranchsearchError(f"unknown arrival process {process!r}; use poisson or constant")


@dataclass(frozen=True)
class Step:
    """One level of load: an arrival rate (open loop) or a number of users (closed loop)."""

    load: float
    duration_s: float


def parse_ramp(spec: str) -> list[float]:
    """'START:STOP:STEP' -> [START, START+STEP, …, ≤ STOP] (STOP included when it is reached)."""
    try:
        start, stop, step = (float(x) for x in spec.split(":"))
    except ValueError:
        raise BranchsearchError(f"--ramp {spec!r}: expected START:STOP:STEP, e.g. 0.5:8:0.5") \
            from None
    if not all(math.isfinite(x) for x in (start, stop, step)):
        raise BranchsearchError(f"--ramp {spec!r}: START, STOP and STEP must be numbers "
                                "(not nan or inf)")
    if start <= 0 or step <= 0 or stop < start:
        raise BranchsearchError(f"--ramp {spec!r}: need 0 < START <= STOP and STEP > 0")
    n = int((stop - start) / step + 1e-9) + 1
    if n > 200:
        raise BranchsearchError(f"--ramp {spec!r}: {n} steps; at most 200")
    return [round(start + i * step, 9) for i in range(n)]


def plan_steps(loads: list[float], step_duration_s: float,
               total_s: float | None = None, drain_s: float = 0.0) -> tuple[list[Step], int]:
    """Steps that fit in `total_s` (each step costs its duration plus at most `drain_s`).
    Returns the steps and how many were left out to stay within the bound (`step_duration_s`
    > 0: `run.load_spec` checks every length first)."""
    steps = [Step(load, step_duration_s) for load in loads]
    if total_s is None:
        return steps, 0
    fit = max(int((total_s + 1e-9) // (step_duration_s + drain_s)), 1)
    return steps[:fit], max(len(steps) - fit, 0)
