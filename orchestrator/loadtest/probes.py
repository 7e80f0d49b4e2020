"""What the deployment was doing during a step: GPUs (NVML), Ray resources, LLM engines, and the
service's Prometheus counters. Every probe is optional and never breaks the load test: one that
cannot read says why in its output instead.

`Sampler` polls GPU and Ray every `interval_s` on a thread during a step; engine and service
counters are read before and after the step and reported as rates over the step.
"""

from __future__ import annotations

import sys
import threading
import time


# --- GPU ------------------------------------------------------------------------------------

def gpu_devices() -> tuple[list[dict], str]:
    """One reading per device ({index, name, util_pct, mem_used_mib, mem_total_mib}); the list
    is empty and the reason says why when there is no GPU or no NVML."""
    try:
        import pynvml
    except ImportError:
        return [], "no GPU probe (install branchsearch[loadtest] for nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, …
        return [], f"no GPU (NVML: {exc})"
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                        "util_pct": float(util.gpu), "mem_used_mib": mem.used / 2**20,
                        "mem_total_mib": mem.total / 2**20})
        return out, "" if out else "no GPU (NVML sees no device)"
    except Exception as exc:
        return [], f"GPU probe failed: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def summarize_gpu(readings: list[list[dict]]) -> dict:
    """Per device over a step's readings: mean and max utilisation, max memory used."""
    by_dev: dict[int, list[dict]] = {}
    for reading in readings:
        for d in reading:
            by_dev.setdefault(d["index"], []).append(d)
    return {str(i): {"name": rs[0]["name"],
                     "util_pct_mean": round(sum(r["util_pct"] for r in rs) / len(rs), 1),
                     "util_pct_max": max(r["util_pct"] for r in rs),
                     "mem_used_mib_max": round(max(r["mem_used_mib"] for r in rs)),
                     "mem_total_mib": round(rs[0]["mem_total_mib"])}
            for i, rs in sorted(by_dev.items())}


# --- Ray ------------------------------------------------------------------------------------

def ray_usage() -> dict | None:
    """Resources in use on the Ray cluster this process is connected to (None if none)."""
    if "ray" not in sys.modules:  # never imported: not connected (and not worth importing)
        return None
    try:
        import ray

        if not ray.is_initialized():
            return None
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception:
        return None
    keys = [k for k in total if k in ("CPU", "GPU", "memory", "object_store_memory")]
    return {k: {"used": total[k] - free.get(k, 0.0), "total": total[k]} for k in keys}


def summarize_ray(readings: list[dict]) -> dict:
    if not readings:
        return {}
    out = {}
    for k in readings[0]:
        used = [r[k]["used"] for r in readings if k in r]
        scale = 2**30 if "memory" in k else 1
        unit = "_gib" if scale > 1 else ""
        out[k] = {f"used{unit}_mean": round(sum(used) / len(used) / scale, 3),
                  f"used{unit}_max": round(max(used) / scale, 3),
                  f"total{unit}": round(readings[0][k]["total"] / scale, 3)}
    return out


# --- LLM engines ----------------------------------------------------------------------------

def engine_counters(settings=None) -> dict[str, dict]:
    """Cumulative counters of the LLM engines this process can see: the named engine actors on
    the Ray cluster, and in-process vLLM engines. {name: {requests, completion_tokens, seconds,
    batches?}}; empty when no engine runs."""
    out: dict[str, dict] = {}
    try:
        if "ray" not in sys.modules:
            raise ImportError
        import ray

        if ray.is_initialized() and settings is not None:
            from branchsearch.workers.engine_actor import NAMESPACE, engine_name

            for i in range(max(getattr(settings, "llm_engines", 1), 1)):
                try:
                    actor = ray.get_actor(engine_name(i), namespace=NAMESPACE)
                    out[engine_name(i)] = ray.get(actor.stats.remote(), timeout=10)
                except Exception:
                    continue
    except ImportError:
        pass
    try:
        factory = sys.modules.get("branchsearch.workers.factory")  # loaded if an engine is
        for model, engine in getattr(factory, "_LOCAL", {}).items():
            out[f"local:{model}"] = dict(engine.stats.__dict__)
    except Exception:
        pass
    return out


def engine_rates(before: dict[str, dict], after: dict[str, dict], wall_s: float) -> dict:
    """Per engine over a step: requests, completion tokens/s, busy share of the step, and the
    mean batch (requests per engine batch) when the engine counts its batches."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in a if isinstance(a.get(k), (int, float))}
        row = {"requests": d.get("requests", 0),
               "completion_tokens": d.get("completion_tokens", 0),
               "completion_tokens_per_s": round(d.get("completion_tokens", 0) / wall_s, 2)
               if wall_s > 0 else 0.0,
               "busy_share": round(d.get("seconds", 0) / wall_s, 3) if wall_s > 0 else 0.0}
        if d.get("batches"):
            row["mean_batch"] = round(d["requests"] / d["batches"], 2)
        out[name] = row
    return out


# --- the service's /metrics -----------------------------------------------------------------

def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {'name{labels}': value}; comments and junk skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


def metric_deltas(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Counters (`_total`, `_count`, `_sum`) as per-second rates over the step, gauges as their
    value after it; only branchsearch_* and vllm metrics, histogram buckets left out."""
    out = {}
    for key, value in sorted(after.items()):
        name = key.split("{", 1)[0]
        if not (name.startswith("branchsearch_") or name.startswith("vllm")) \
                or name.endswith("_bucket") or name.endswith("_created"):
            continue
        if name.endswith(("_total", "_count", "_sum")):
            delta = value - before.get(key, 0.0)
            if delta:
                out[key + " /s"] = round(delta / wall_s, 4) if wall_s > 0 else 0.0
        else:
            out[key] = value
    return out


class Sampler:
    """Polls GPUs and Ray on a thread while a step runs."""

    def __init__(self, interval_s: float = 1.0, gpu: bool = True, ray: bool = True):
        self.interval_s, self.gpu, self.ray = interval_s, gpu, ray
        self.gpu_readings: list[list[dict]] = []
        self.ray_readings: list[dict] = []
        self.gpu_reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while True:
            if self.gpu:
                devices, reason = gpu_devices()
                if devices:
                    self.gpu_readings.append(devices)
                else:
                    self.gpu_reason, self.gpu = reason, False  # stop asking
            if self.ray:
                usage = ray_usage()
                if usage:
                    self.ray_readings.append(usage)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "Sampler":
        self._thread = threading.Thread(target=self._poll, daemon=True, name="loadtest-probe")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def summary(self) -> dict:
        return {"gpu": summarize_gpu(self.gpu_readings) or (self.gpu_reason or "no GPU"),
                "ray": summarize_ray(self.ray_readings) or "not connected to Ray"}



def metrics_settle_s() -> float:
    """How long after a step a service's /metrics holds all of its requests: under Ray Serve
    the replica a scrape reaches adds the others' counts as they last shared them, every
    `SharedMetrics.PUSH_S` seconds, so a scrape right at a step's end misses the last
    ones."""
    from branchsearch.orchestrator.service.deploy import SharedMetrics

    return SharedMetrics.PUSH_S + 1.0


class StepProbe:
    """Everything probed around one step: a `Sampler` during it, engine counters and the
    service's /metrics before and after it (`metrics_settle_s` after: every replica's counts
    in)."""

    def __init__(self, settings=None, metrics_text=None, interval_s: float = 1.0):
        self.settings, self.metrics_text, self.interval_s = settings, metrics_text, interval_s

    def __enter__(self) -> "StepProbe":
        self._engines = engine_counters(self.settings)
        self._metrics = parse_prometheus(self.metrics_text() or "") if self.metrics_text else {}
        self._sampler = Sampler(self.interval_s).__enter__()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self._sampler.__exit__()
        self._wall = time.monotonic() - self._t0
        if exc[0] is not None:  # a step cut short (^C): its summary is made now, unprobed
            return
        self._engines_after = engine_counters(self.settings)
        self._metrics_after = {}
        if self.metrics_text:  # the rates stay over the step's own time (`_wall`)
            time.sleep(metrics_settle_s())
            self._metrics_after = parse_prometheus(self.metrics_text() or "")

    def result(self) -> dict:
        out = self._sampler.summary()
        engines = engine_rates(self._engines, self._engines_after, self._wall)
        if engines:
            out["engines"] = engines
        if self.metrics_text:
            out["service_metrics"] = (metric_deltas(self._metrics, self._metrics_after,
                                                    self._wall)
                                      if self._metrics_after else "no /metrics answer")
            out["service_metrics_window_s"] = round(self._wall, 3)  # rate x window: counts
        return out
