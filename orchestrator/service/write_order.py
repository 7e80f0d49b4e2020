"""The order of document writes: of two writes to one document, the later to arrive stands.

An upsert is chunked and embedded before its index's write turn (`searcher`), so a long
document's write can reach the turn after a write to the same document that arrived later
(a caller who had a 504 and sent a corrected version, a DELETE). Written then, it would put
back what that later write replaced or deleted. Each write takes a ticket as it begins; one
that reaches its turn after a later ticket wrote one of its documents is superseded and writes
nothing (409 `write_superseded`)."""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager


class WriteOrder:
    """Tickets of the service's document writes and, per (index, document id), the ticket of
    the last write that landed, kept while a write begun before it is still open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self._open: set[int] = set()
        self._landed: dict[tuple[str, str], int] = {}

    @contextmanager
    def ticket(self):
        """A ticket for one write, in order of beginning; held until the write has ended."""
        with self._lock:
            ticket = next(self._tickets)
            self._open.add(ticket)
        try:
            yield ticket
        finally:
            with self._lock:
                self._open.discard(ticket)
                oldest = min(self._open, default=None)
                # a landing no open write began before can supersede nothing: forgotten
                self._landed = {k: t for k, t in self._landed.items()
                                if oldest is not None and t > oldest}

    def superseded(self, index: str, ids: list[str], ticket: int) -> str | None:
        """The first of `ids` a write with a later ticket has written to `index`, else None.
        Asked in the index's write turn."""
        with self._lock:
            return next((i for i in ids if self._landed.get((index, i), 0) > ticket), None)

    def landed(self, index: str, ids: list[str], ticket: int) -> None:
        """`ids` written to `index` by the write of `ticket` (in its write turn)."""
        with self._lock:
            for i in ids:
                self._landed[(index, i)] = max(ticket, self._landed.get((index, i), 0))
