"""`branchsearch loadtest`: validate options, build the target and workload, run, report."""

from __future__ import annotations

import math
import os
import platform
import re
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from branchsearch.infra.errors import BranchsearchError, IndexNotFound, redact
from branchsearch.infra.config.settings import Settings
from branchsearch.orchestrator.loadtest import arrivals, report as rep, workload as wl
from branchsearch.orchestrator.loadtest.generator import Generator, LoadSpec
from branchsearch.orchestrator.loadtest.probes import StepProbe
from branchsearch.orchestrator.loadtest.stats import is_rejected, is_unavailable
from branchsearch.orchestrator.loadtest.targets import DriverTarget, HttpTarget, RequestFailed


KEY_ENV = "BRANCHSEARCH_API_KEY"
# what one load-test process can hold: a step's requests (each a Sample, drawn before the step)
# and its threads (a user each, or a request in flight each); past these it never sends on time
# and a step's memory and length grow without bound (--rate 1e9 drew 2e9 send times)
MAX_STEP_REQUESTS = 100_000
MAX_THREADS = 10_000
DEFAULT_KEY_SLOTS = Settings().per_key_concurrency  # a service's, unless its 429s say theirs
MIN_STEP_S = 1.0  # a shorter step measures next to nothing (no request, or one)
REDACTED = "REDACTED"  # shell-safe: the command line stays copyable


def read_keys(key_file: Path | None = None, key: str | None = None,
              env: dict | None = None) -> tuple[tuple[str, ...], str]:
    """The service keys and where they came from: `--key-file` (one key a line; blank lines
    and `#` comments skipped), else `--key` (kept for old scripts), else BRANCHSEARCH_API_KEY,
    else none. Each request takes the least busy key (`HttpTarget`): a service limits each
    key's searches in flight (`per_key_concurrency`), so one key measures that limit, and
    several load the service as several callers do. The source is what a report may say; no
    key is ever written."""
    env = os.environ if env is None else env
    if key_file is not None and key is not None:
        raise BranchsearchError("give the key once: --key-file or --key (or "
                                f"{KEY_ENV} in the environment)")
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8-sig")  # a BOM: not the key
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise BranchsearchError(f"--key-file {key_file}: cannot read it ({why})") from None
        keys = tuple(dict.fromkeys(line.strip() for line in text.splitlines()
                                   if line.strip() and not line.strip().startswith("#")))
        if not keys:
            raise BranchsearchError(f"--key-file {key_file} is empty: put a key on each line")
        many = f" ({len(keys)} keys)" if len(keys) > 1 else ""
        return _sendable(keys, f"--key-file {key_file}"), f"--key-file {key_file}{many}"
    if key:
        return _sendable((key.strip(),), "--key"), "--key"
    if env.get(KEY_ENV, "").strip():
        return _sendable((env[KEY_ENV].strip(),), KEY_ENV), KEY_ENV
    return (), "none"


def _sendable(keys: tuple[str, ...], source: str) -> tuple[str, ...]:
    """`keys`, each of which an HTTP header can carry: visible ASCII (a key of `branchsearch
    keys add` is bs_ and letters, digits, - and _). Another ("ключ", a CR LF inside) is one
    line naming where it came from, never the key."""
    for i, key in enumerate(keys):
        if not all("!" <= c <= "~" for c in key):
            which = f"key {i + 1} of {len(keys)}" if len(keys) > 1 else "the key"
            raise BranchsearchError(f"{source}: {which} holds a space, a control character or "
                                    "a character outside ASCII, which no HTTP header carries; "
                                    "give the key `branchsearch keys add` printed")
    return keys


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the value of `--key` (`--key K`, `--key=K`) replaced."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append(REDACTED)
            hide = False
        elif arg == "--key":
            out.append(arg)
            hide = True
        elif arg.startswith("--key="):
            out.append("--key=" + REDACTED)
        else:
            out.append(arg)
    return out


def scrub(value, secrets):
    """`value` (a report: dicts, lists, strings) with every occurrence of each of `secrets` (a
    key, or several) in its strings replaced: whatever text reaches the report (a server's
    error detail included)."""
    secrets = [secrets] if isinstance(secrets, str) else [x for x in secrets if x]
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    return value


@dataclass
class Options:
    url: str | None = None
    keys: tuple[str, ...] = ()  # never written (the report says where from: key_source)
    key_source: str = "none"
    queries: Path | None = None
    synth: int | None = None
    rate: float | None = None
    users: int | None = None
    ramp: str | None = None
    loop: str | None = None  # open | closed; default: closed with --users, else open
    arrivals: str | None = None  # open loop: poisson (default) | constant
    duration_s: float | None = None
    step_duration_s: float = 20.0
    drain_s: float = 10.0
    max_inflight: int = 256
    think_s: float = 0.0
    warmup: int = 2
    seed: int = 0
    slo_p99_ms: float | None = None
    stop_at_knee: bool = True
    branches: int | None = None
    k: int | None = None
    deadline_s: float | None = None
    executor: str = "ray"
    concurrency: int | None = None  # questions the driver runs at once (its actor pool)
    timeout_s: float = 120.0
    report: Path | None = None
    plots: Path | None = None


def load_spec(o: Options) -> tuple[LoadSpec, list[str]]:
    """The steps to run, and notes about what was cut to keep the run bounded."""
    notes = []
    for flag, value in (("--rate", o.rate), ("--users", o.users), ("--duration", o.duration_s),
                        ("--step-duration", o.step_duration_s), ("--drain", o.drain_s),
                        ("--think", o.think_s), ("--timeout-s", o.timeout_s),
                        ("--deadline-s", o.deadline_s), ("--slo-p99-ms", o.slo_p99_ms)):
        if value is not None and not math.isfinite(value):  # nan and inf: no bounded run
            raise BranchsearchError(f"{flag} {value}: give a number (not nan or inf)")
    # every rate and length is checked, also one this run does not use (--step-duration
    # without --ramp): a value of the wrong sign is a mistake, never silently dropped. A
    # deadline of 0 would fail every request, an SLO of 0 judge nothing; a drain or a think
    # time of 0 is no wait.
    for flag, value, zero_ok in (
            ("--rate", o.rate, False), ("--users", o.users, False),
            ("--duration", o.duration_s, False), ("--step-duration", o.step_duration_s, False),
            ("--deadline-s", o.deadline_s, False), ("--slo-p99-ms", o.slo_p99_ms, False),
            ("--timeout-s", o.timeout_s, False), ("--drain", o.drain_s, True),
            ("--think", o.think_s, True)):
        if value is not None and (value < 0 or (value == 0 and not zero_ok)):
            raise BranchsearchError(f"{flag} {value:g}: must be {'>= 0' if zero_ok else '> 0'}")
    if o.max_inflight < 1:
        raise BranchsearchError(f"--max-inflight {o.max_inflight}: must be >= 1")
    loop = o.loop or ("closed" if o.users is not None and o.rate is None else "open")
    if loop not in ("open", "closed"):
        raise BranchsearchError(f"--loop {loop!r}: use open or closed")
    if o.rate is not None and o.users is not None:
        raise BranchsearchError("give --rate (open loop) or --users (closed loop), not both")
    if o.ramp:
        if o.rate is not None or o.users is not None:
            raise BranchsearchError("--ramp replaces --rate/--users; use --loop closed to ramp "
                                    "users")
        loads = arrivals.parse_ramp(o.ramp)
        if loop == "closed":
            if any(x != int(x) for x in loads):
                raise BranchsearchError(f"--ramp {o.ramp}: users must be whole numbers")
        steps, cut = arrivals.plan_steps(loads, o.step_duration_s, o.duration_s, o.drain_s)
        not_reached = "raise the ramp's STOP"
        if cut:
            notes.append(f"--duration {o.duration_s:g} s leaves room for {len(steps)} of "
                         f"{len(loads)} ramp steps: the last {cut} were not run")
            not_reached = f"--duration {o.duration_s:g} s ran {len(steps)} of the ramp's " \
                          f"{len(loads)} steps: lengthen it"
    else:
        load = o.rate if loop == "open" else o.users
        if load is None:
            raise BranchsearchError("give --rate R (open loop), --users U (closed loop) or "
                                    "--ramp START:STOP:STEP")
        steps = [arrivals.Step(float(load), o.duration_s if o.duration_s else 30.0)]
        not_reached = "one load measured; --ramp START:STOP:STEP looks for the knee"
    process = o.arrivals or "poisson"
    if process not in arrivals.PROCESSES:
        raise BranchsearchError(f"--arrivals {o.arrivals!r}: use poisson or constant")
    if o.arrivals is not None and loop == "closed":  # a flag that would change nothing
        raise BranchsearchError("--arrivals shapes an open loop's sends (--rate); a closed "
                                "loop's users send when answered: drop --arrivals")
    if o.think_s and loop == "open":
        raise BranchsearchError("--think is a closed loop's pause between an answer and the "
                                "next question (--users); an open loop sends at its rate: "
                                "drop --think")
    _each_step_sends(steps, loop, process, o)
    return LoadSpec(loop, tuple(steps), process, o.drain_s, o.max_inflight, o.think_s,
                    o.seed, o.warmup, o.stop_at_knee, o.slo_p99_ms, not_reached), notes


def _each_step_sends(steps: list[arrivals.Step], loop: str, process: str, o: Options) -> None:
    """Every step sends something, within what one process can send: a step of no request
    would report no answers and no knee, one past these bounds would never end on time."""
    length = "--step-duration" if o.ramp else "--duration"
    if o.max_inflight > MAX_THREADS:
        raise BranchsearchError(f"--max-inflight {o.max_inflight}: at most {MAX_THREADS:,} "
                                "(a thread each); for more load run several loadtests, or "
                                "Locust")
    for i, step in enumerate(steps):
        if step.duration_s < MIN_STEP_S:
            raise BranchsearchError(f"{length} {step.duration_s:g}: a step must last at least "
                                    f"{MIN_STEP_S:g} s (a shorter one measures next to nothing)")
        if loop == "closed":
            if step.load > MAX_THREADS:
                raise BranchsearchError(f"{int(step.load)} users: at most {MAX_THREADS:,} users "
                                        "in one process (a thread each); for more load run "
                                        "several loadtests, or Locust")
            continue
        expected = step.load * step.duration_s
        if expected > MAX_STEP_REQUESTS:
            raise BranchsearchError(f"{step.load:g}/s for {step.duration_s:g} s: {expected:.3g} "
                                    f"requests in a step, at most {MAX_STEP_REQUESTS:,} (one "
                                    "process sends a few hundred a second at best); for more "
                                    "load run several loadtests, or Locust")
        if expected < 1:  # a constant rate sends one at 0, reported as 1/duration a second
            raise BranchsearchError(f"{step.load:g}/s for {step.duration_s:g} s is less than "
                                    f"one request a step: lengthen {length} or raise the rate")
        if not arrivals.schedule(process, step.load, step.duration_s, seed=o.seed + i):
            raise BranchsearchError(f"{step.load:g}/s for {step.duration_s:g} s sends no "
                                    f"request (the {process} arrivals of --seed {o.seed}): "
                                    f"lengthen {length}, raise the rate or change the seed")


def make_workload(o: Options, settings: Settings) -> wl.Workload:
    if (o.queries is None) == (o.synth is None):
        raise BranchsearchError("give the workload: --queries FILE or --synth N")
    if o.queries is not None:
        return wl.from_file(o.queries, o.seed)
    if o.synth < 1:
        raise BranchsearchError("--synth N needs N >= 1")
    folder = Path(settings.home) / "loadtest-synth" / f"tasks{o.synth}-seed{o.seed}"
    return wl.from_synth(folder, o.synth, seed=o.seed)


def make_target(o: Options, settings: Settings, workload: wl.Workload):
    if o.url:
        shown = _shown_url(o.url)
        if not o.url.startswith(("http://", "https://")):
            raise BranchsearchError(f"--url {shown!r}: expected http(s)://host:port")
        try:
            netloc = urlsplit(o.url).netloc
        except ValueError as exc:  # "http://[::1" and the like
            raise BranchsearchError(f"--url {shown!r} is not a URL ({exc})") from None
        if "@" in netloc:  # urllib would take "user:pw@host" for the host name
            raise BranchsearchError(f"--url {shown!r} holds a user or password; the service "
                                    "takes an API key (--key-file, BRANCHSEARCH_API_KEY): give "
                                    "the URL without them")
        if "?" in o.url or "#" in o.url:  # /v1/search would land in the query: every request
            # a 405, and a token in the query printed in the report
            raise BranchsearchError(f"--url {shown}: give the "
                                    "service's address alone (http(s)://host:port[/prefix]), "
                                    "without a ?query or #fragment; the key goes in --key-file "
                                    "or BRANCHSEARCH_API_KEY")
        return HttpTarget(o.url, o.keys, index=settings.index if settings.index != "default"
                          else None, branches=o.branches, k=o.k, deadline_s=o.deadline_s,
                          timeout_s=o.timeout_s)
    from branchsearch.orchestrator.driver import Driver

    if not (settings.index_dir / "docs.sqlite").exists():
        if o.synth is None:
            raise IndexNotFound(f"index {settings.index!r} not found under {settings.home}: "
                                "ingest it first (branchsearch ingest … --index NAME)")
        from branchsearch.infra.ingest.pipeline import ingest

        print(f"index {settings.index!r} missing: ingesting the synth corpus {workload.corpus}",
              file=sys.stderr)
        ingest(workload.corpus, settings)
    elif o.synth is not None:
        _same_synth_corpus(settings, workload, o)
    branches = o.branches or settings.branches
    pool = branches * (o.concurrency or max(settings.batch_concurrency, 1))
    executor = "local" if o.executor == "local" else "ray"
    driver = Driver(settings, mode=executor, **({"pool_size": pool} if executor == "ray" else {}))
    return DriverTarget(driver, branches=o.branches, deadline_s=o.deadline_s)


def _shown_url(url: str) -> str:
    """`url` as an error line may show it: no ?query or #fragment (a token may stand there,
    under any name) and no user or password."""
    address, cut = re.split(r"[?#]", url, maxsplit=1)[0], "?" in url or "#" in url
    if "@" in address:
        address = "***@" + address.rsplit("@", 1)[1]
    return redact(address) + ("…" if cut else "")


def _same_synth_corpus(settings: Settings, workload: wl.Workload, o: Options) -> None:
    """An existing index asked `--synth N` questions must hold that synth corpus: another
    one's (another N or seed, or any other corpus) would be asked about documents it does not
    hold, and measure searches that find nothing."""
    from branchsearch.infra.index.manifest import read_manifest

    manifest = read_manifest(settings.index_dir)
    made_from = manifest.corpus if manifest is not None else ""
    if made_from and Path(made_from) != Path(workload.corpus).resolve():
        raise BranchsearchError(
            f"index {settings.index!r} was ingested from {made_from}, not from the corpus of "
            f"--synth {o.synth} --seed {o.seed} ({workload.corpus}): its questions would ask "
            "about documents it does not hold; give --index a new name (it is ingested "
            "first), or the --synth and --seed it was made with")


def preflight(target: HttpTarget, question: str) -> None:
    """One question with each key before any load: a refused key (any of a --key-file's), a
    missing index, a wrong path (any 4xx but 429) or an unreachable URL is one clear error
    now, not a report full of identical errors. So is a service that cannot search (a 503
    `backend_unavailable`, `not_ready`, `index_starting`, …: its backend down, or still
    starting) and a deadline that a question asked twice before any load does not meet (504;
    twice: the first may wake a cold engine): their steps would measure neither, and read as
    saturation at the first step."""
    keys = target.keys or (None,)
    for i, key in enumerate(keys):
        try:
            try:
                target.search(question, key=key)
            except RequestFailed as first:
                if not first.outcome.startswith("http_504"):
                    raise
                target.search(question, key=key)
        except RequestFailed as exc:
            detail = f" ({scrub(str(exc), target.keys)})" if str(exc) != exc.outcome else ""
            which = f" with key {i + 1} of {len(keys)}" if len(keys) > 1 else ""
            got = f"--url {target.url}: the first question{which} got {exc.outcome}{detail}"
            if is_rejected(exc.outcome) or exc.outcome.startswith("error:"):
                raise BranchsearchError(f"{got}; check --url, the key (--key-file or "
                                        f"{KEY_ENV}) and --index") from None
            if is_unavailable(exc.outcome):
                raise BranchsearchError(f"{got}: the service cannot search now (its backend "
                                        "or index is unavailable, or still starting), so no "
                                        "load was sent; run the load test once it answers"
                                        ) from None
            if exc.outcome.startswith("http_504"):
                deadline = target.body.get("deadline_s")
                raise BranchsearchError(
                    f"{got}, twice, before any load: the service does not answer within "
                    + (f"--deadline-s {deadline:g}" if deadline else "its default deadline")
                    + " even unloaded, so no load was sent; give a longer --deadline-s"
                    ) from None


def preflight_driver(target: DriverTarget, question: str) -> None:
    """The in-process target's `preflight`: one question before any load. A driver that cannot
    search (`unavailable:<code>`: its backend down, every branch failed) or fails it
    (`error:<Class>`) is one clear error now; so is a deadline that the question asked twice
    (the first may load a model or warm a cache) does not meet, every branch out of time:
    every request of the run would fail so, and read as saturation at the first step."""
    for _ in range(2):
        try:
            result = target.search(question)
        except RequestFailed as exc:
            detail = f" ({exc})" if str(exc) != exc.outcome else ""
            got = (f"index {target.driver.settings.index!r}: the first question got "
                   f"{exc.outcome}{detail}")
            if is_unavailable(exc.outcome):
                raise BranchsearchError(f"{got}: it cannot search now (its backend is "
                                        "unavailable), so no load was sent; run the load test "
                                        "once it answers") from None
            raise BranchsearchError(f"{got}, so no load was sent") from None
        branches = result.get("branches") or []
        if not branches or any(b.get("status") != "timeout" for b in branches):
            return
    flag = (f"--deadline-s {target.deadline_s:g}" if target.deadline_s is not None else
            f"the branch timeout (branch_timeout_s {target.driver.settings.branch_timeout_s:g})")
    raise BranchsearchError(f"{flag}: the first question, asked twice before any load, had "
                            "every branch out of time: the driver does not answer within it "
                            "even unloaded, so no load was sent; give a longer --deadline-s")


@contextmanager
def _sigterm_interrupts():
    """Meanwhile a SIGTERM (`timeout`, a CI job cancelled, `kill PID`) stops the run as ^C does,
    the step under way kept as partial; the list it yields records that one came. A SIGTERM
    this process was made to ignore stays ignored."""
    came: list[int] = []

    def stop(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield came
        return
    was = signal.signal(signal.SIGTERM, stop)
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, was if was is not None else signal.SIG_DFL)


def machine() -> dict:
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {"cpus": os.cpu_count(), "platform": platform.platform(terse=True),
            "python": platform.python_version(), "load_average": load}


def key_queue_note(most_per_key: int, key_slots: int | None, key_queue: int | None) -> str:
    """What a report says when one key had more requests under way than the slots the service
    runs for it (`per_key_concurrency`: as its 429s named it, else the default): the service
    queues a key's requests past its slots (`per_key_queue`, within their deadline) before
    refusing them, so the latency of those it took includes that wait, not said apart. Nothing
    when its 429s said it has no queue (those past its slots were refused: the 429 note).
    `most_per_key` counts the requests the service took on (`HttpTarget.most_per_key`), not
    those it refused at once."""
    slots = key_slots or DEFAULT_KEY_SLOTS
    if most_per_key <= slots or key_queue == 0:
        return ""
    said = (f"its {_n(slots, 'slot')} (per_key_concurrency, as the service's refusals said)"
            if key_slots else f"the service's default per_key_concurrency of {slots} (unless "
            "this service allows a key more)")
    return (f"up to {most_per_key} of one key's requests were under way at once (sent and not "
            f"refused at once), past {said}: those past the slots waited in the key's queue "
            "(per_key_queue), and that wait is in the latency of those it then answered (stage "
            "outside_server): this measures the key's queue as well as the service; add keys "
            "to --key-file or raise the service's per_key_concurrency")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def refusal_notes(reasons: dict[str, int], slots: int | None, queue: int | None, keys: int,
                  deadline_s: float | None) -> list[str]:
    """What a report says of the keys' 429s, one note for each `reason` their bodies gave
    (`service.admission`: the key's queue full, no queue, or its deadline passed waiting in
    it), with the limits they gave (`slots`, `queue`) and what fits each: more keys and a
    larger per_key_queue, a per_key_queue at all, a longer deadline. `keys`: how many the
    load used. Nothing for a reason not given (a service that sends no reasons: `loadtest`'s
    note without them)."""
    many = keys > 1
    whose = f"the {keys} keys'" if many else "the key's"
    measures = f"this measures the {'keys' if many else 'key'}, not the service"
    more_keys = ("add keys to --key-file" if many else "put several keys in --key-file (one a "
                 "line: each request takes the least busy)")
    notes = []
    if n := reasons.get("queue_full"):
        held = (f"each key had {slots} running and {queue} waiting" if many
                else f"{slots} ran and {queue} waited")
        notes.append(f"{whose} {'queues were' if many else 'queue was'} full: {n} requests "
                     f"were refused at once (429 too_many_requests) while {held} "
                     f"(per_key_concurrency {slots}, per_key_queue {queue}), and refusals count "
                     f"as errors: past that {measures}; {more_keys} or raise the service's "
                     "per_key_queue")
    if n := reasons.get("no_queue"):
        past = f"each key's {slots}" if many else f"its {slots}"
        notes.append(f"{whose} own concurrency {'limits' if many else 'limit'} refused {n} "
                     f"requests at once (429 too_many_requests): past {past} running "
                     f"(per_key_concurrency {slots}) the service queues none (per_key_queue "
                     f"0), and refusals count as errors: past that limit {measures}; "
                     f"{more_keys}, or give the service a per_key_queue (a key's requests past "
                     "its slots then wait for one) or a larger per_key_concurrency")
    if n := reasons.get("deadline_in_queue"):
        deadline = (f"--deadline-s {deadline_s:g}" if deadline_s is not None
                    else "the service's default_deadline_s")
        behind = (f"their queues behind each key's {slots} running" if many
                  else f"its queue behind its {slots} running")
        notes.append(f"{n} of {whose} requests waited in {behind} (per_key_concurrency "
                     f"{slots}, per_key_queue {queue}) until their deadline ({deadline}) and "
                     "were refused (429 too_many_requests), and refusals count as errors: "
                     f"{'the keys' if many else 'the key'}'{'' if many else 's'} requests wait "
                     f"longer than their deadline allows; give a longer --deadline-s, "
                     f"{more_keys} or raise the service's per_key_concurrency")
    return notes


# what a 503 `overloaded` of each `reason` says of the run, and the setting that moves the limit
_SERVER_LIMITS = {
    "max_in_flight": ("the service's requests in flight reached its max_in_flight",
                      "raise the service's max_in_flight, or add instances"),
    "max_open_indexes": ("every index the service keeps open had a request in flight",
                         "raise the service's max_open_indexes"),
    "branch_actors": ("no branch actors were free within the deadline",
                      "give the cluster more branch actors (CPUs or GPUs), or a longer "
                      "--deadline-s"),
    "searcher_queue": ("Ray Serve's queue for the searcher was full",
                       "raise searcher_max_queued (`branchsearch serve --max-queued`) or add "
                       "searcher replicas"),
}


def overload_notes(reasons: dict[str, int], limits: dict[str, dict[str, int]]) -> list[str]:
    """What a report says of the service's 503 `overloaded`, one note for each `reason`
    their bodies gave, with the limits they gave for it (`limits`: by reason, then setting
    name; read from the fields, not the detail's prose): the load passed a limit of the
    service's own, not of its keys."""
    notes = []
    for reason, n in sorted(reasons.items()):
        what, fix = _SERVER_LIMITS.get(reason, (f"a limit of the service's ({reason})",
                                                "see the service's limits"))
        given = limits.get(reason) or {}
        limit = f" ({', '.join(f'{k} {v}' for k, v in sorted(given.items()))})" if given else ""
        were = "was" if n == 1 else "were"
        notes.append(f"{what}{limit}: {_n(n, 'request')} {were} refused at once (503 "
                     "overloaded), and "
                     "refusals count as errors: past that this measures the service's "
                     f"admission limit, not its search; {fix}")
    return notes


def loadtest(o: Options, settings: Settings, progress=None, argv: list[str] | None = None,
             note: str | None = None) -> dict:
    """Run the whole load test; returns the report (also written when o.report is set).
    `note` (the index the home's only one) is said on stderr once the options are checked."""
    spec, notes = load_spec(o)
    workload = make_workload(o, settings)
    target = make_target(o, settings, workload)
    if note:
        print(note, file=sys.stderr)
    if isinstance(target, HttpTarget):
        preflight(target, workload.question(0))
    else:
        try:
            preflight_driver(target, workload.question(0))
        except BaseException:
            target.close()
            raise
    metrics_text = (lambda: target.get("/metrics")) if isinstance(target, HttpTarget) else None
    probe = lambda: StepProbe(settings if not o.url else None, metrics_text)  # noqa: E731
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    info = {"machine": machine(), "target": target.describe()}
    if isinstance(target, HttpTarget):
        info["target"]["key"] = f"from {o.key_source}" if o.keys else "none"
    try:
        with _sigterm_interrupts() as signals:
            result = Generator(target, workload, spec, probe=probe, progress=progress).run()
    finally:
        target.close()
    if result["interrupted"]:
        result["terminated"] = bool(signals)
        notes.append(f"interrupted ({'SIGTERM' if signals else 'Ctrl-C'}): the steps finished "
                     "so far, and the one under way as far as it got (marked partial)")
    by_reason = refusal_notes(target.key_refusals, target.key_slots, target.key_queue,
                              len(o.keys), o.deadline_s) if isinstance(target, HttpTarget) else []
    notes.extend(by_reason)
    if isinstance(target, HttpTarget):
        notes.extend(overload_notes(target.server_refusals, target.server_limits))
    if not by_reason and any("http_429:too_many_requests" in s.get("refusals", {})
                             for s in result["steps"]):  # a service that gives no reasons
        if len(o.keys) > 1:  # "put several keys in --key-file" would be what was done
            notes.append(f"the {len(o.keys)} keys' own concurrency limits refused requests "
                         "(429 too_many_requests), and refusals count as errors: past them "
                         "this measures the keys, not the service; add keys to --key-file or "
                         "raise the service's per_key_concurrency")
        else:
            notes.append("the key's own concurrency limit refused requests (429 "
                         "too_many_requests), and refusals count as errors: past that limit "
                         "this measures the key, not the service; put several keys in "
                         "--key-file (one a line: each request takes the least busy) or raise "
                         "the service's per_key_concurrency")
    if isinstance(target, HttpTarget) and (note := key_queue_note(
            target.most_per_key, target.key_slots, target.key_queue)):
        notes.append(note)
    if spec.loop == "open" and any(s["send_lag_ms"]["p99"] and s["send_lag_ms"]["p99"] > 20
                                   for s in result["steps"]):
        notes.append("the generator sent late (send lag p99 > 20 ms): this client is a "
                     "bottleneck; latency still counts from the scheduled times")
    report = {"command": shlex.join(redact_argv(argv or sys.argv)), "started": started,
              **info,
              "workload": workload.describe(),
              "arrivals": {"loop": spec.loop, "process": spec.process,
                           "step_duration_s": spec.steps[0].duration_s, "drain_s": spec.drain_s,
                           "max_inflight": spec.max_inflight, "think_s": spec.think_s,
                           "seed": spec.seed, "warmup": spec.warmup},
              "notes": notes, **result}
    report = scrub(report, o.keys)  # no key appears anywhere: file, plots, stdout
    if o.plots:
        report["plots"] = rep.plots(report, o.plots)
    if o.report:
        rep.write(report, o.report)
    return report
