"""Load testing a deployment (`branchsearch loadtest`): open- and closed-loop load against the
driver or the HTTP service, bounded in time, with a report of latency, achieved rate, the
saturation knee, per-stage time, engine, GPU and Ray use.

Modules: `arrivals` (send schedules, ramp steps), `workload` (questions), `targets` (driver,
HTTP), `generator` (runs the steps), `stats` (percentiles, knee, SLO), `probes` (GPU, Ray,
engines, /metrics), `report` (JSON, Markdown, plots), `run` (the command).
"""
