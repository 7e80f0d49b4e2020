"""Which retriever replica serves the next branch (`ReplicaBalancer`), and where a branch runs
(`Placement`: a pool actor, or hosted by a retriever replica)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


class ReplicaBalancer:
    """Which retriever replica serves the next branch (or question: `take(branches)`): the one
    with the fewest branches in flight, ties broken round-robin (so a quiet pool still
    spreads). A branch keeps its replica for all its tool calls; `done(i, branches)` when it
    ends. Thread-safe (concurrent questions)."""

    def __init__(self, replicas: int):
        if replicas < 1:
            raise ValueError("at least one replica")
        self.load = [0] * replicas  # branches in flight per replica
        self.served = [0] * replicas  # branches sent to each replica, ever
        self.hosting = [False] * replicas  # whether the replica runs a hosted branch now
        self._next = 0
        self._lock = threading.Lock()

    def take(self, branches: int = 1) -> int:
        with self._lock:
            n = len(self.load)
            order = [(self._next + j) % n for j in range(n)]
            pick = min(order, key=lambda r: self.load[r])  # first least-loaded in rotation
            self.load[pick] += branches
            self.served[pick] += branches
            self._next = (pick + 1) % n
            return pick

    def charge(self, replica: int, branches: int) -> None:
        """`branches` more in flight on `replica`, a replica already chosen (a question's
        later wave, on the replica that holds its cache)."""
        with self._lock:
            self.load[replica] += branches
            self.served[replica] += branches

    def done(self, replica: int, branches: int = 1) -> None:
        with self._lock:
            self.load[replica] = max(self.load[replica] - branches, 0)

    def host(self, replica: int) -> bool:
        """Claim the replica's one hosted-branch slot; False when another branch holds it."""
        with self._lock:
            if self.hosting[replica]:
                return False
            self.hosting[replica] = True
            return True

    def unhost(self, replica: int) -> None:
        with self._lock:
            self.hosting[replica] = False


@dataclass
class Placement:
    """Where one branch runs: a pool actor, or hosted by retriever replica `replica` (`actor`
    None; its events under `events`)."""

    ref: object
    replica: int
    actor: object = None
    events: str | None = None
