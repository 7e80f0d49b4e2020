"""The readiness board of a Ray Serve application: what `/readyz` and `GET /v1/indexes` answer,
and the searcher's part of `/metrics`.

    searcher replica ─ posts every PUBLISH_S ─▶ board (a Ray actor) ◀─ read ─ ingress

Searches wait in the searcher deployment's Serve queue, and a burst fills it; a readiness probe,
an index list or a scrape asked through that queue would wait behind them, or be refused with
them, though the searcher is up and healthy. So each searcher replica runs its readiness check
and lists its indexes on a thread of its own (`Publisher`) and posts the answers, with its ACL
guard's count, on the board, a named actor of the application, and the ingress replicas answer
from the board with no call into the searcher's queue (`BoardReader`). A post older than `STALE_S` is a searcher gone
or wedged: 503 `not_ready`, saying so. Each caller's view (the indexes its key may use) is
cut from the board's answers by the ingress, as from the searcher's own.

`serve --standalone` has no board: its app asks the searcher in its own process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from branchsearch.infra.errors import error_line
from branchsearch.orchestrator.service.errors import ApiError, api_error

log = logging.getLogger("branchsearch.service")
BOARD_NAMESPACE = "serve"  # the application's named actors (boards, owner), found by `serve`
PUBLISH_S = 2.0  # how often a searcher replica posts its answers
# a post older than this is of a searcher gone or wedged: a live one posts at least every
# PUBLISH_S plus its check's bound (5 s), so three periods and the bound
STALE_S = 3 * PUBLISH_S + 5.0
READ_WAIT_S = 2.0  # how long the ingress waits for the board's answer


def readiness_board(app: str) -> str:
    """The name of application `app`'s readiness board."""
    return f"{app}-readiness"


@dataclass(frozen=True)
class Published:
    """A searcher replica's answers: its readiness check's (the `/readyz` body before it is cut
    to a caller's view, or its 503), its index names (or the error listing them met), and its
    figures in `/metrics` (`Searcher.gauges_now`: the ids its ACL guard removed, its searches past
    their deadline still waiting on a backend)."""

    ready: dict | ApiError
    indexes: list[str] | ApiError
    gauges: dict = field(default_factory=dict)


class ReadinessBoard:
    """The board (a Ray actor): each searcher replica's latest post, with when it came. A post
    gone stale is dropped at the next post (a replica that died without withdrawing: killed,
    its node lost), so the board holds at most the replicas of the last `STALE_S`."""

    def __init__(self):
        self.posts: dict[str, tuple[float, Published]] = {}

    def post(self, replica: str, published: Published) -> None:
        now = time.monotonic()
        self.posts = {r: p for r, p in self.posts.items() if now - p[0] <= STALE_S}
        self.posts[replica] = (now, published)

    def withdraw(self, replica: str) -> None:
        """`replica` stops: its answers are no longer the application's."""
        self.posts.pop(replica, None)

    def read(self) -> list[tuple[float, Published]]:
        """Every post, each with its age in seconds."""
        now = time.monotonic()
        return [(now - at, published) for at, published in self.posts.values()]


def current(posts: list[tuple[float, Published]], stale_s: float = STALE_S) -> Published:
    """The application's answers from the board's `posts` (age, answers): those of a replica
    that is ready, if any is (a search goes to whichever replica is free), the youngest such;
    else the youngest post. 503 `not_ready` when no post is younger than `stale_s`."""
    fresh = sorted((post for post in posts if post[0] <= stale_s), key=lambda post: post[0])
    if not fresh:
        youngest = min((age for age, _ in posts), default=None)
        said = ("has not published whether it is ready (still starting, or gone)"
                if youngest is None else
                f"has not said whether it is ready for {youngest:.0f} s (gone, or wedged)")
        raise ApiError(503, "not_ready", f"the searcher {said}", {"Retry-After": "5"})
    ready = [published for _, published in fresh if isinstance(published.ready, dict)]
    return ready[0] if ready else fresh[0][1]


def gauges(posts: list[tuple[float, Published]], stale_s: float = STALE_S) -> dict | None:
    """The searcher's figures (`Searcher.gauges_now`) over its replicas whose posts (age, answers)
    are younger than `stale_s` (each replica counts its own: summed); None when there is none."""
    fresh = [published.gauges for age, published in posts if age <= stale_s]
    if not fresh:
        return None
    return {name: sum(g.get(name, 0) for g in fresh) for name in set().union(*fresh)}


def answered(ask, *errors: type[BaseException], logged: dict | None = None) -> object:
    """`ask()`'s value, or the ApiError it raised (or one of `errors`, as its ApiError: the
    caller reads "details in the server log", so the error goes there with its traceback, once
    while it repeats: `logged` holds the last error line logged for each `ask`)."""
    logged = {} if logged is None else logged
    try:
        value = ask()
    except ApiError as exc:
        value = exc
    except errors as exc:
        line = error_line(exc, 300)
        if logged.get(ask) != line:
            log.error("readiness board: %s", line, exc_info=True)
        logged[ask] = line
        return api_error(exc)
    logged.pop(ask, None)
    return value


class Publisher:
    """A searcher replica's side: its answers posted on the board every `PUBLISH_S` seconds,
    from a daemon thread (not the replica's request loop, nor its Serve queue). The board is
    made by the first replica that posts, and made anew when it died with that replica. The
    first post is made before the constructor returns, so a replica Serve counts as running
    has its answers on the board (a probe right after the service says it serves is answered)."""

    def __init__(self, searcher, name: str, replica: str):
        self.searcher, self.name, self.replica = searcher, name, replica
        self._handle = None
        self._stop = threading.Event()
        self._turn = threading.Lock()  # a post and the stop's withdrawal, one at a time
        self._failed = 0  # posts failed in a row
        self._ready, self._names = searcher._ready_now, searcher.index_names
        self._logged: dict = {}  # the error each of them last met, logged once (`answered`)
        self._post()
        threading.Thread(target=self._run, daemon=True, name="readiness-board").start()

    def _board(self):
        """The board, made on this replica's node when there is none: the loss of another
        node does not take it away while the searcher lives. The node is required, not
        preferred: Ray may place a softly asked actor on another node, and the loss of that
        node would then make every ingress answer 503 while the searcher still searches."""
        if self._handle is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                  soft=False)
            self._handle = ray.remote(ReadinessBoard).options(
                name=self.name, namespace=BOARD_NAMESPACE, get_if_exists=True, num_cpus=0,
                scheduling_strategy=here).remote()
        return self._handle

    def answers(self) -> Published:
        """The replica's readiness check and index names, each an error when it failed (any
        error: the thread goes on publishing), and its figures in `/metrics`."""
        return Published(answered(self._ready, Exception, logged=self._logged),
                         answered(self._names, Exception, logged=self._logged),
                         self.searcher.gauges_now())

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self._post()

    def _post(self) -> None:
        import ray

        published = self.answers()
        with self._turn:
            for attempt in (1, 2):  # the board died with its owner replica: made anew at once
                if self._stop.is_set():
                    return
                try:
                    ray.get(self._board().post.remote(self.replica, published), timeout=30)
                    self._failed = 0
                    return
                except Exception as exc:  # noqa: BLE001 — a board gone, or not answering
                    self._handle = None
                    if attempt == 2:
                        self._failed += 1
                        (log.warning if self._failed >= 3 else log.debug)(
                            "readiness board: %d post(s) failed: %s", self._failed,
                            error_line(exc, 300))

    def stop(self) -> None:
        """No more posts, and this replica's taken off the board."""
        self._stop.set()
        with self._turn:  # (a post under way lands first, and is withdrawn)
            if self._handle is None:  # no board reached: none to take it off
                return
            try:
                import ray

                ray.get(self._handle.withdraw.remote(self.replica), timeout=5)
            except Exception as exc:  # noqa: BLE001 — the board is gone: nothing to take off
                log.debug("readiness board: %s", error_line(exc, 300))


class BoardReader:
    """An ingress replica's side: the application's answers read from the board."""

    def __init__(self, name: str):
        self.name = name
        self._handle = None

    async def current(self) -> Published:
        """`current` of the board's posts; 503 `not_ready` when the board has none fresh, or
        is not there, or does not answer within `READ_WAIT_S` (no searcher replica has
        published, or the one that made the board has just gone)."""
        return current(await self.posts())

    async def posts(self) -> list[tuple[float, Published]]:
        """The board's posts (age, answers); [] when it is not there, or does not answer
        within `READ_WAIT_S`."""
        began = time.monotonic()
        posts = []
        for attempt in (1, 2):  # a board gone with its owner: once more, found anew
            try:
                posts = await asyncio.wait_for(
                    self._read(), max(READ_WAIT_S - (time.monotonic() - began), 0.1))
                break
            except Exception as exc:  # noqa: BLE001 — no board (yet), or one gone
                self._handle = None
                if attempt == 2 or time.monotonic() - began >= READ_WAIT_S:
                    log.warning("not ready: the readiness board: %s", error_line(exc, 300))
                    break
        return posts

    async def _read(self) -> list:
        if self._handle is None:
            import ray

            self._handle = await asyncio.to_thread(ray.get_actor, self.name,
                                                   namespace=BOARD_NAMESPACE)
        return await self._handle.read.remote()
