"""The service's logic as plain functions: keys, limits, event framing and the ACL guard.
No server, no Ray."""

import json
import threading
import time

import pytest

from branchsearch.infra.errors import (BackendUnavailable, BadQuery, IndexBusy, IndexIncomplete,
                                       IndexNotFound, KeysFileError)
from branchsearch.orchestrator.service import events as stream
from branchsearch.orchestrator.service.auth import AuthError, KeyStore, bearer, digest, parse_list
from branchsearch.orchestrator.service.admission import Concurrency, Limits, check_body_size
from branchsearch.orchestrator.service.errors import ApiError, api_error
from branchsearch.orchestrator.service.protocol import parse_search
from branchsearch.orchestrator.result import BranchReport
from branchsearch.workers.harness import EpisodeResult


class FakeDriver:
    """A driver with no stores: its open and close are lines in `log` ("open N", "close N")."""

    def __init__(self, n: int, log: list[str]):
        self.n, self.log = n, log
        log.append(f"open {n}")

    def close(self):
        self.log.append(f"close {self.n}")


def test_keys_store_only_hashes_and_revoke_takes_effect(tmp_path):
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    key = store.add("alice", ("alpha", "beta"), ("docs",))
    assert key.startswith("bsk_") and len(key) > 40
    text = path.read_text()
    assert key not in text and digest(key) in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    other = KeyStore(path)  # a server reading the same file
    grant = other.authenticate(key)
    assert grant.groups == ("alpha", "beta") and grant.may_use("docs")
    assert not grant.may_use("other") and not grant.admin
    with pytest.raises(AuthError, match="unknown"):
        other.authenticate(key + "x")
    with pytest.raises(AuthError, match="missing"):
        other.authenticate(None)
    store.revoke("alice")
    with pytest.raises(AuthError, match="revoked"):
        other.authenticate(key)  # re-read on change, no restart
    with pytest.raises(Exception, match="exists"):
        store.add("bob", ()) and store.add("bob", ())
    assert [k.name for k in store.list()] == ["alice", "bob"]
    assert bearer("Bearer abc") == "abc" and bearer("Basic abc") is None and bearer(None) is None
    assert parse_list("a, b,,a") == ("a", "b")
    with pytest.raises(Exception, match="--indexes: index name '../x' is not allowed"):
        store.add("carol", (), ("../x",))  # a name no index can have: refused, not inert
    # a key name of any script, as index and group names
    assert store.authenticate(store.add("фин-1", ("финансы",))).name == "фин-1"
    import unicodedata

    decomposed = unicodedata.normalize("NFD", "café-2")  # typed on macOS: the same key
    assert store.authenticate(store.add(decomposed, ())).name == "café-2"
    store.revoke(decomposed)
    for bad in ("", "-x", "a b", "a/b", "x" * 65, "alice\n"):
        with pytest.raises(Exception, match="bad key name"):
            store.add(bad, ())


def test_what_a_caller_is_told_keeps_placeholders_and_names_a_wrong_type():
    """The 401 hint said "Bearer ***" (the placeholder KEY taken for a secret); a question
    that is a number was "empty"."""
    from branchsearch.infra.errors import public_line
    from branchsearch.workers.query import question_problem

    assert public_line("missing API key: send 'Authorization: Bearer KEY'").endswith(
        "'Authorization: Bearer KEY'")
    assert "s3cr3t" not in public_line("Authorization: Bearer s3cr3t")
    # a store's error naming its file, in a 503 body: no server path
    assert public_line("milvus at /srv/bs/indexes/uni/dense.db: upsert failed (internal)") == \
        "milvus at <path>: upsert failed (internal)"
    assert public_line("count failed (connect failed: unix:/tmp/tmpljj8tpcj_dense.db.sock: "
                       "No such file)") == "count failed (connect failed: <server>: No such file)"
    assert public_line("PUT /v1/indexes/uni/documents: 1/2 done") == \
        "PUT /v1/indexes/uni/documents: 1/2 done"  # API routes and ratios stay
    # gRPC's peer addresses (a Milvus server down, as a 503 body showed it: "<server>.93.0.1:…")
    for peer in ("ipv4:10.93.0.1:19530", "ipv6:[fe80::1]:19530", "dns:///milvus.corp:19530"):
        line = public_line(f"count failed (last error: UNKNOWN: {peer}: Failed to connect)")
        assert line == "count failed (last error: UNKNOWN: <server> Failed to connect)", line
    for text in ("addr:10.0.0.5:19530", "milvus:10.93.0.1:19530", "endpoint:10.93.0.1",
                 "IPV4:10.0.0.1:1"):  # any word before an address (the review's cases)
        line = public_line(f"failed ({text}: refused)")
        assert "10." not in line and ".0." not in line and "<server>" in line, line
    assert public_line("collection not loaded[collection=470918235429536255]") == \
        "collection not loaded[collection=<hidden>]"  # Milvus's internal id
    assert public_line("collection=docs_ix not loaded") == "collection=docs_ix not loaded"
    # a search's 503 said "BackendUnavailable: elasticsearch at <server> …" and a PUT's, in the
    # same outage, "elasticsearch at <server> …": our own errors are their message alone
    from branchsearch.infra.errors import BackendUnavailable
    down = BackendUnavailable("elasticsearch at http://u:pw@10.0.0.7:9200 is not reachable")
    assert public_line(down) == "elasticsearch at <server> is not reachable"
    assert public_line(ConnectionRefusedError(111, "refused")).startswith("ConnectionRefused")
    # a branch's error event after its retriever died (a 2-node cluster): no memory address
    line = public_line("search failed after 2 retries: The actor died because of an error "
                       "raised in its creation task, ray::RetrieverService.__init__() (pid=4242, "
                       "ip=10.79.0.2, actor_id=3c1f0a7b9d2e4f6a8b0c1d2e03000000, repr=<branchsearch."
                       "infra.retrieval.service.RetrieverService object at 0x7f3a2c1b5e90>)")
    assert "0x7f" not in line and "10.79" not in line and "4242" not in line, line
    assert line.endswith("repr=<branchsearch.infra.retrieval.service.RetrieverService object>)")
    assert question_problem(123) == "question must be text, not a number"
    assert question_problem(["a"]) == "question must be text, not an array"
    assert question_problem(None).startswith("empty question")


def test_parse_search_bounds():
    limits = Limits(max_question_chars=50, max_branches=4)
    req = parse_search({"question": "  who?  ", "branches": 2, "k": 3, "deadline_s": 1.5}, limits)
    assert (req.question, req.branches, req.k, req.deadline_s) == ("who?", 2, 3, 1.5)
    bad = [None, [], {}, {"question": ""}, {"question": "?!?"}, {"question": "x" * 51}, {"question": "q", "branches": 0},
           {"question": "q", "branches": 5}, {"question": "q", "k": True},
           {"question": "q", "deadline_s": -1}, {"question": "q", "deadline_s": float("nan")},
           {"question": "q", "index": "../etc"}, {"question": "q", "acl_groups": ["bravo"]}]
    for body in bad:
        with pytest.raises(ApiError) as err:
            parse_search(body, limits)
        assert err.value.status == 422, body
    with pytest.raises(ApiError, match="come from the API key"):
        parse_search({"question": "q", "acl": ["x"]}, limits)
    assert parse_search({"question": "q", "k": 10}, limits).k == 10
    with pytest.raises(ApiError, match=r"\[1, 10\] \(a search returns at most the settings' "
                       "final_k chunks"):  # (not taken, then cut to 10)
        parse_search({"question": "q", "k": 11}, limits)
    with pytest.raises(ApiError) as err:
        check_body_size(11, Limits(max_body_bytes=10))
    assert err.value.status == 413


def test_a_question_holding_a_control_character_is_a_422():
    """A question holding U+0000 (or another C0, DEL or C1 control character) was searched;
    now a 422 naming the character, in the usual error body. Tab, newline and carriage return
    are text."""
    limits = Limits()
    for char in ("\x00", "\x01", "\x08", "\x0b", "\x0c", "\x1b", "\x1f", "\x7f", "\x85",
                 "\x9b"):  # C0, DEL and C1 (U+009B: a terminal's 8-bit ESC[)
        with pytest.raises(ApiError) as err:
            parse_search({"question": f"harbor{char}festival"}, limits)
        assert (err.value.status, err.value.error) == (422, "bad_request"), repr(char)
        assert f"control character U+{ord(char):04X}" in err.value.detail
        assert set(err.value.body()) == {"error", "detail"} and char not in err.value.detail
    assert parse_search({"question": "harbor\tfestival\r\nin June"}, limits).question == \
        "harbor\tfestival\r\nin June"


def test_concurrency_per_key_then_total():
    conc = Concurrency(Limits(per_key_concurrency=2, max_in_flight=3))
    with conc.slot("a"), conc.slot("a"):
        with pytest.raises(ApiError) as err:
            with conc.slot("a"):
                pass
        assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
        with conc.slot("b"):
            with pytest.raises(ApiError) as err:
                with conc.slot("c"):
                    pass
            assert err.value.status == 503
    assert conc.total == 0 and not conc._per_key
    with conc.slot("a"):  # released slots are reusable, also after an exception inside
        pass
    errors = []

    def worker():
        try:
            with conc.slot("z"):
                threading.Event().wait(0.05)
        except ApiError as exc:
            errors.append(exc.status)
    threads = [threading.Thread(target=worker) for _ in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert conc.total == 0 and errors and set(errors) <= {429, 503}


def test_a_server_of_one_slot_says_its_one_request_in_words():
    """The 503 of a server whose `max_in_flight` is 1 says "1 request in flight", not "1
    requests", and gives the figures as fields."""
    conc = Concurrency(Limits(per_key_concurrency=2, max_in_flight=1))
    with conc.slot("a"):
        with pytest.raises(ApiError) as err:
            with conc.slot("b"):
                pass
    assert err.value.status == 503
    assert err.value.detail == "1 request in flight; the server takes 1"


def test_a_key_past_its_slots_waits_in_order_within_its_deadline():
    """`Concurrency.admit`: past its key's slots a request waits, first come first served, for
    the slot one frees (the counts never pass the limits); one whose deadline comes first is
    refused 429, one whose caller left leaves the queue, and a slot handed to a waiter that
    gave up meanwhile goes to the next: none is lost."""
    import asyncio
    import time

    conc = Concurrency(Limits(per_key_concurrency=2, per_key_queue=2, max_in_flight=10))

    async def run():
        far = time.monotonic() + 30
        a, b = await conc.admit("k", far), await conc.admit("k", far)
        first = asyncio.create_task(conc.admit("k", far))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(conc.admit("k", far))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:  # two wait: refused at once
            await conc.admit("k", far)
        assert full.value.status == 429 and "2 waiting" in full.value.detail
        other = await conc.admit("other", far)  # another key: admitted at once
        b.let_go()
        got = await asyncio.wait_for(first, 5)  # the first to wait is the first served
        assert not second.done() and conc._per_key["k"] == 2
        second.cancel()  # its caller left
        await asyncio.sleep(0.01)
        assert conc.waiting("k") == 0
        with pytest.raises(ApiError) as late:  # its deadline passes while it waits
            await conc.admit("k", time.monotonic() + 0.2)
        assert late.value.status == 429 and "(its deadline)" in late.value.detail
        for slot in (a, got, other):
            slot.let_go()

    asyncio.run(run())
    assert conc.total == 0 and not conc._per_key and conc.waiting("k") == 0


def test_a_slot_held_by_a_search_thread_is_let_go_once_by_its_thread_or_its_deadline():
    """A search's thread holds its request's slot (`Slot.hold`); at the request's deadline a
    stuck thread gives its key's place back (`Slot.outlive`), and its own end later frees
    nothing more of the key's: the key's count never goes below what runs. The server's count
    keeps the stuck thread until it ends, so `max_in_flight` still bounds the threads a hung
    backend holds (a key answered 504 each deadline would otherwise start them without end)."""
    conc = Concurrency(Limits(per_key_concurrency=1, max_in_flight=3))
    slot = conc.take("k")
    release = slot.hold()
    slot.let_go()  # the request's answer is out; its thread still runs
    assert conc._per_key == {"k": 1}
    end = slot.outlive(release)  # its deadline
    assert not conc._per_key and conc.total == 1  # the key's place back; the thread counted
    again = conc.take("k")  # the key's next search is admitted
    release()  # the stuck thread ends at last: nothing more of the key's is freed
    with pytest.raises(ApiError) as full:
        conc.take("k")
    assert full.value.status == 429
    other = conc.take("other")
    with pytest.raises(ApiError) as busy:  # the stuck thread, `again`, `other`: the server's 3
        conc.take("third")
    assert busy.value.status == 503
    end()
    end()  # (counts once)
    assert conc.total == 2
    conc.take("third").let_go()
    other.let_go()
    again.let_go()
    assert conc.total == 0 and not conc._per_key


def test_a_503_max_in_flight_says_how_many_of_its_requests_are_stuck_past_their_deadline():
    """Searches whose threads wait on a hung backend past their deadline keep the server's
    places until they end; when they fill `max_in_flight`, the 503 says so (its line, and
    `past_deadline` as a field), and `past_deadline` counts them until each ends: the operator
    sees a backend to look at, not load."""
    conc = Concurrency(Limits(per_key_concurrency=3, max_in_flight=2))
    ends = []
    for _ in range(2):
        slot = conc.take("k")
        thread = slot.hold()
        slot.let_go()  # its 504 is out
        ends.append(slot.outlive(thread))
    assert (conc.total, conc.past_deadline) == (2, 2)
    with pytest.raises(ApiError) as busy:
        conc.take("k")
    assert busy.value.status == 503
    assert busy.value.detail == ("2 requests in flight (2 of them past the deadline, answered "
                                 "504 and still waiting on a backend); the server takes 2")
    assert busy.value.fields == {"reason": "max_in_flight", "in_use": 2,
                                 "limits": {"max_in_flight": 2}, "past_deadline": 2}
    ends[0]()
    ends[0]()  # (counts once)
    held = conc.take("k")  # a search that runs: in flight, not past its deadline
    with pytest.raises(ApiError) as busy:
        conc.take("k")
    assert busy.value.detail == ("2 requests in flight (1 of them past the deadline, answered "
                                 "504 and still waiting on a backend); the server takes 2")
    ends[1]()
    assert conc.past_deadline == 0
    other = conc.take("k")
    with pytest.raises(ApiError) as busy:  # only load: the line says no more than that
        conc.take("k")
    assert busy.value.detail == "2 requests in flight; the server takes 2"
    assert busy.value.fields["past_deadline"] == 0
    held.let_go()
    other.let_go()
    assert (conc.total, conc.past_deadline) == (0, 0)


def test_a_search_thread_stuck_past_its_deadline_counts_also_when_its_request_waited():
    """A request that waited in its key's queue is handed its slot by the request before it
    (`admit`); its thread, stuck past its deadline, keeps its place in the server's count as
    any other's (`Slot.outlive`), so a key's queue cannot feed stuck threads past
    `max_in_flight` either."""
    import asyncio

    conc = Concurrency(Limits(per_key_concurrency=1, per_key_queue=1, max_in_flight=2))

    async def run():
        first = conc.take("k")
        waiting = asyncio.ensure_future(conc.admit("k", time.monotonic() + 10))
        await asyncio.sleep(0.05)
        first_thread = first.hold()
        first.let_go()
        first_end = first.outlive(first_thread)  # its 504: the slot goes to the waiter
        second = await waiting
        second_thread = second.hold()
        second.let_go()
        second_end = second.outlive(second_thread)
        assert conc.total == 2 and not conc._per_key  # two stuck threads, no key's slot held
        with pytest.raises(ApiError) as busy:
            conc.take("other")
        assert busy.value.status == 503
        first_end()
        second_end()
        assert conc.total == 0

    asyncio.run(run())


def test_a_keys_429_says_why_and_its_limits_as_fields():
    """A key's 429 carries, besides its line for people, why it was refused (its queue full,
    its deadline passed waiting, no queue at all), how many of the key's requests ran and
    waited then, and the key's limits, as fields a client reads (`loadtest` does); they cross
    a Ray Serve handle with the error (its pickle)."""
    import asyncio
    import pickle
    import time

    def limits(queue):
        return {"per_key_concurrency": 1, "per_key_queue": queue}

    async def run(conc):
        far = time.monotonic() + 30
        slot = await conc.admit("k", far)
        waiter = asyncio.create_task(conc.admit("k", far))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:
            await conc.admit("k", far)
        waiter.cancel()
        slot.let_go()
        return full.value

    full = asyncio.run(run(Concurrency(Limits(per_key_concurrency=1, per_key_queue=1))))
    assert full.body() == {"error": "too_many_requests", "detail": full.detail,
                           "reason": "queue_full", "running": 1, "waiting": 1,
                           "limits": limits(1)}, full.body()

    async def past_deadline(conc):
        far = time.monotonic() + 30
        slot = await conc.admit("k", far)
        with pytest.raises(ApiError) as late:
            await conc.admit("k", time.monotonic() + 0.05)
        slot.let_go()
        return late.value

    late = asyncio.run(past_deadline(Concurrency(Limits(per_key_concurrency=1,
                                                        per_key_queue=2))))
    assert {k: v for k, v in late.body().items() if k != "detail"} == {
        "error": "too_many_requests", "reason": "deadline_in_queue", "running": 1,
        "waiting": 0, "limits": limits(2)}, late.body()

    async def no_queue(conc):
        slot = await conc.admit("k", time.monotonic() + 30)
        with pytest.raises(ApiError) as at_once:
            await conc.admit("k", time.monotonic() + 30)
        slot.let_go()
        return at_once.value

    at_once = asyncio.run(no_queue(Concurrency(Limits(per_key_concurrency=1, per_key_queue=0))))
    assert at_once.body()["reason"] == "no_queue" and at_once.body()["limits"] == limits(0)
    assert (at_once.body()["running"], at_once.body()["waiting"]) == (1, 0)
    crossed = pickle.loads(pickle.dumps(full))  # as a Serve handle carries it (`Refused`)
    assert crossed.body() == full.body() and crossed.headers == {"Retry-After": "1"}


def test_a_serve_replica_keeps_one_key_to_half_its_requests():
    """Under Ray Serve a waiting search holds one of its searcher replica's ongoing requests:
    a key's queue is cut so its running and waiting searches take half of them at most."""
    from branchsearch.orchestrator.service.admission import for_replica

    assert for_replica(Limits(per_key_concurrency=4, per_key_queue=16), 16).per_key_queue == 4
    assert for_replica(Limits(per_key_concurrency=4, per_key_queue=2), 16).per_key_queue == 2
    assert for_replica(Limits(per_key_concurrency=8, per_key_queue=16), 16).per_key_queue == 0
    assert for_replica(Limits(per_key_concurrency=4, per_key_queue=16), 64).per_key_queue == 16


def test_errors_map_to_statuses_without_internals():
    assert api_error(BackendUnavailable("es down")).status == 503
    assert api_error(IndexNotFound("nope")).status == 404
    assert api_error(BadQuery("bad")).status == 422
    damaged = api_error(IndexIncomplete("index 'x' is damaged: /srv/bs/x/dense.db missing"))
    assert damaged.status == 503 and "/srv" not in damaged.detail  # the server's; no paths
    busy = api_error(IndexBusy("index 'x' is being ingested right now (PID 7, corpus /srv/c)"))
    assert busy.status == 409 and "/srv" not in busy.detail and "PID" not in busy.detail
    assert busy.headers == {"Retry-After": "5"}  # a client retries it: the ingest ends
    keys = api_error(KeysFileError("keys file /srv/bs/keys.json is not valid (Expecting …)"))
    assert (keys.status, keys.body()["error"]) == (503, "keys_unavailable")  # not the caller's
    assert "/srv" not in keys.detail
    # raised in a Serve replica: its own status, not "the replica is restarting"
    import ray.exceptions

    from branchsearch.orchestrator.service.app import _unwrap

    wrapped = ray.exceptions.RayTaskError("search", "tb", BackendUnavailable(
        "ray: 2 branch actor(s) did not start within 300 s")).as_instanceof_cause()
    assert type(wrapped).__name__ == "RayTaskError(BackendUnavailable)"
    unwrapped = _unwrap(wrapped)
    assert unwrapped.body() == {"error": "backend_unavailable", "detail": "ray: 2 branch "
                                "actor(s) did not start within 300 s"}
    died = api_error(BackendUnavailable(  # a dead actor's Ray error names its process
        "retriever actor: ActorDiedError: The actor died unexpectedly. class_name: "
        "RetrieverService actor_id: f2390abc pid: 3976 namespace: 3dd960c6-1a2b (pid=20962, "
        "ip=192.0.2.2, actor_id=6dc6fb83)"))
    assert died.status == 503 and "actor died unexpectedly" in died.detail
    assert not [n for n in ("3976", "20962", "f2390abc", "3dd960c6", "6dc6fb83", "192.0.2.2")
                if n in died.detail], died.detail
    gone = api_error(BackendUnavailable("The actor 5f3a9c0e1d2b3a4f5e6d7c8b01000000 is "
                                        "unavailable; PID 4567, Worker ID: ab12, namespace: "
                                        "'serve'"))
    assert not [n for n in ("5f3a9c0e", "4567", "ab12", "serve") if n in gone.detail], gone.detail
    crash = api_error(KeyError("/secret/path"))
    assert crash.status == 500 and "secret" not in crash.detail
    err = ApiError(429, "too_many_requests", "slow down", {"Retry-After": "1"})
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (again.status, again.body(), again.headers) == (429, err.body(), err.headers)


def test_a_failed_branch_shows_callers_neither_its_backend_address_nor_a_password():
    """A branch whose backend died mid-search reports it in `error` and in its episode's
    `detail`: both reach a caller only through `public_line` (found by a hostile pass: the
    emulator's host:port in `detail` of a partial result)."""
    line = ("search failed after 2 retries: BackendUnavailable: elasticsearch at "
            "http://elastic:S3cret@10.1.2.3:35275 is not reachable")
    branch = {"index": 1, "status": "error", "error": line, "detail": line}
    for event in (stream.public({"type": "result", "result": {"branches": [branch]}}),
                  stream.public({"type": "branch_done", **branch})):
        said = json.dumps(event)
        assert "10.1.2.3" not in said and "S3cret" not in said and "35275" not in said, said
        assert "not reachable" in said


def test_events_are_framed_and_the_result_keeps_its_status():
    from branchsearch.orchestrator.result import SearchResult, result_status

    events = [{"type": "plan", "subqueries": ["q"]},
              {"type": "search", "branch": 0, "tool": "search_corpus", "query": "harbor",
               "new_ids": ["d#p0"]},
              {"type": "prune", "branch": 0, "ids": ["d#p0"], "reason": "off topic"}]
    frames = "".join(stream.sse(e) for e in events)
    assert frames.startswith("event: plan\ndata: ") and stream.parse_sse(frames) == events
    ok = BranchReport(0, "q", 1.0, "original", "ok", episode=EpisodeResult("q", "finish"))
    dead = BranchReport(1, "q2", 1.0, "entity", "error", error="BackendUnavailable: x")
    evidence = [{"doc_id": "d", "title": "", "score": 1, "chunks": [
        {"chunk_id": "d#p0", "found_by": []}, {"chunk_id": "d#p1", "found_by": []}]}]
    out = stream.result_dict(SearchResult("q", evidence, ["d#p0", "d#p1"], [ok, dead], {}, "t"),
                             k=1)
    assert out["status"] == "partial" and out["ranked_chunk_ids"] == ["d#p0"]
    assert [c["chunk_id"] for d in out["evidence"] for c in d["chunks"]] == ["d#p0"]
    assert result_status([]) == "failed" and result_status(["ok", "timeout"]) == "partial"


def test_acl_guard_drops_hidden_ids_everywhere():
    from branchsearch.infra.stores.acl import acl_visible

    assert acl_visible([], ["a"]) and acl_visible(["a"], ["a", "b"])
    assert not acl_visible(["b"], ["a"]) and acl_visible(["b"], ["*"])
    hidden = lambda ids: {i for i in ids if i.startswith("secret")}  # noqa: E731
    event, dropped = stream.guard({"type": "search", "new_ids": ["ok#p0", "secret#p0"]}, hidden)
    assert event["new_ids"] == ["ok#p0"] and dropped == 1
    covered = {"type": "covered", "branch": 1, "subquery": "Secret Plan", "by": [
        "Open Page", "Secret Plan"], "ids": ["ok#p0", "secret#p0"]}
    event, dropped = stream.guard(covered, hidden)  # a hidden page's title goes with its id
    assert (event["by"], event["ids"], dropped) == (["Open Page"], ["ok#p0"], 1)
    result = {"ranked_chunk_ids": ["secret#p0", "ok#p0"], "branches": [
        {"ranked_chunk_ids": ["secret#p0"], "pruned_ids": [], "final_context_ids": ["secret#p0"]}],
        "evidence": [{"doc_id": "secret", "chunks": [{"chunk_id": "secret#p0"}]},
                     {"doc_id": "ok", "chunks": [{"chunk_id": "ok#p0"}]}]}
    event, dropped = stream.guard({"type": "result", "result": result}, hidden)
    assert "secret" not in json.dumps(event) and dropped == 1
    assert event["result"]["evidence"][0]["doc_id"] == "ok"
    # the result lists its covered branches as their events do: the same rule applies there,
    # also when a hidden page is named nowhere else in the result
    only = {"ranked_chunk_ids": ["ok#p0"], "branches": [], "evidence": [],
            "covered": [{k: v for k, v in covered.items() if k != "type"}]}
    event, dropped = stream.guard({"type": "result", "result": only}, hidden)
    assert event["result"]["covered"] == [{"branch": 1, "subquery": "Secret Plan",
                                           "by": ["Open Page"], "ids": ["ok#p0"]}]
    assert "secret" not in json.dumps(event["result"]["covered"]) and dropped == 1
    # a visible chunk found through a hidden one names it among its provenance's parents (a
    # document whose groups were narrowed while the search ran): the id goes there too
    via = {"ranked_chunk_ids": ["ok#p0"], "branches": [], "evidence": [
        {"doc_id": "ok", "chunks": [{"chunk_id": "ok#p0", "provenance": [
            {"turn": 2, "tool": "search_corpus", "query": "q", "rank": 1, "score": 1.0,
             "parents": ["secret#p0", "open#p3"]}]}]}]}
    event, dropped = stream.guard({"type": "result", "result": via}, hidden)
    assert "secret" not in json.dumps(event) and dropped == 1
    assert event["result"]["evidence"][0]["chunks"][0]["provenance"][0]["parents"] == [
        "open#p3"]


def test_a_driver_that_is_slow_to_start_blocks_only_its_own_index(tmp_path):
    """Starting one index's driver (actors that wait for room on the cluster) must not hold up
    searches of other indexes or unknown-index answers; a failed start leaves nothing behind
    and the next request tries again."""
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.searcher import Searcher

    from branchsearch.infra.index.manifest import Manifest, write_manifest

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    for name in ("slow", "fast"):  # complete indexes as far as the searcher looks
        folder = settings.replace(index=name).index_dir
        folder.mkdir(parents=True)
        (folder / "docs.sqlite").touch()
        write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    release, attempts = threading.Event(), []

    def factory(s, executor):
        attempts.append(s.index)
        if s.index == "slow":
            release.wait(30)
            raise BackendUnavailable("ray: 1 retriever actor(s) did not start")
        return f"driver-{s.index}"

    searcher = Searcher(settings, executor="local", driver_factory=factory)
    failed = []
    slow = threading.Thread(target=lambda: failed.append(
        pytest.raises(BackendUnavailable, searcher.drivers.open, "slow")))
    slow.start()
    waited = time.perf_counter()
    while "slow" not in attempts and time.perf_counter() - waited < 30:
        time.sleep(0.01)
    assert attempts == ["slow"], failed
    started = time.perf_counter()
    assert searcher.drivers.open("fast") == "driver-fast"
    with pytest.raises(IndexNotFound, match="branchsearch ingest"):
        searcher.drivers.open("nope")
    assert time.perf_counter() - started < 5 and slow.is_alive()  # not behind "slow"
    release.set()
    slow.join(30)
    assert failed and "slow" not in searcher.drivers.by_index
    release.set()
    with pytest.raises(BackendUnavailable):  # tried again, not a cached failure
        searcher.drivers.open("slow")
    assert attempts.count("slow") == 2


def test_a_request_waits_for_a_starting_driver_only_until_its_deadline(tmp_path):
    """A driver whose actors wait for room on the cluster (another index's actors hold it):
    the request answered after 313 s with a misleading 'replica restarting' (new-user pass).
    Now it gets a 503 index_starting at its deadline; the start goes on, and a later request
    gets the driver."""
    import time

    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="late").index_dir
    folder.mkdir(parents=True)
    (folder / "docs.sqlite").touch()
    write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    release, starts = threading.Event(), []

    def factory(s, executor):
        starts.append(s.index)
        release.wait(30)
        return "driver-late"

    searcher = Searcher(settings, executor="local", driver_factory=factory)
    began = time.perf_counter()
    with pytest.raises(ApiError) as caught:
        searcher.drivers.open("late", wait=0.3)
    assert time.perf_counter() - began < 5
    assert caught.value.status == 503 and caught.value.body()["error"] == "index_starting"
    assert caught.value.headers == {"Retry-After": "5"}
    threads = threading.active_count()
    for _ in range(20):  # requests meanwhile wait on the one start: no thread each
        with pytest.raises(ApiError):
            searcher.drivers.open("late", wait=0.01)
    assert threading.active_count() == threads
    release.set()
    assert searcher.drivers.open("late", wait=10) == "driver-late" and starts == ["late"]
    with pytest.raises(IndexNotFound):  # a start's own error reaches the request
        searcher.drivers.open("nope", wait=10)


def test_a_copied_index_is_refused_before_its_driver_starts(tmp_path):
    """Under Ray the copied-folder error was raised in the retriever actor's constructor and
    reached the caller as ActorDiedError: a 500. Now the searcher refuses it first (a 503 by
    `api_error`), and starts nothing."""
    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="copy").index_dir
    folder.mkdir(parents=True)
    (folder / "dense.db").write_bytes(b"")
    fields = {f: None for f in Manifest.__dataclass_fields__}
    write_manifest(folder, Manifest(**(fields | {"backends": {
        "dense": f"milvus-lite {tmp_path}/indexes/orig/dense.db (FLAT)", "lexical": "tantivy"}})))
    started = []
    searcher = Searcher(settings, executor="ray",
                        driver_factory=lambda s, executor: started.append(s.index))
    with pytest.raises(IndexIncomplete, match="ingested as 'orig'") as caught:
        searcher.drivers.open("copy")
    assert api_error(caught.value).status == 503 and started == []

def test_an_incomplete_index_is_refused_before_its_driver_starts(tmp_path):
    """The same for an index whose ingest never finished (a docstore, no manifest): its 503
    from the searcher, not a dead retriever actor's 500."""
    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="half").index_dir
    folder.mkdir(parents=True)
    (folder / "docs.sqlite").write_bytes(b"")
    started = []
    searcher = Searcher(settings, executor="ray",
                        driver_factory=lambda s, executor: started.append(s.index))
    with pytest.raises(IndexIncomplete, match="no manifest: its ingest never finished"
                       ) as caught:
        searcher.drivers.open("half")
    assert api_error(caught.value).status == 503 and started == []
    settings.replace(index="bare").index_dir.mkdir()  # no docstore: unknown, no home path
    with pytest.raises(IndexNotFound, match=r"^index 'bare' not found \(make it") as caught:
        searcher.drivers.open("bare")
    assert str(tmp_path) not in str(caught.value) and started == []


def test_a_key_cannot_hold_the_reserved_group(tmp_path):
    """'*' means every document to the backends: a key with it would read every group's
    documents without being an admin key (hostile pass). Refused, and nothing is written."""
    store = KeyStore(tmp_path / "keys.json")
    with pytest.raises(BadQuery, match="reserved"):
        store.add("kstar", ("*",))
    with pytest.raises(BadQuery, match="reserved"):
        store.add("mixed", ("alpha", " * "))
    path = tmp_path / "keys.json"
    assert not path.exists() or "kstar" not in path.read_text()


def test_a_keys_groups_are_nfc(tmp_path):
    """A key made with (or a keys file holding) an NFD `café` holds the group `café` as
    documents and callers name it (NFC)."""
    import unicodedata

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    key = store.add("mac", (f" {nfd}",))
    assert store.authenticate(key).groups == (nfc,)
    data = json.loads(path.read_text())
    data["keys"][0]["groups"] = [nfd]  # written by an older version
    path.write_text(json.dumps(data))
    assert KeyStore(path).authenticate(key).groups == (nfc,)


def test_a_delete_with_a_store_down_changes_nothing(tmp_path):
    """A DELETE while a backend is down was half applied: the docstore (what searches see) went
    first, the store that was down kept the chunks, and the repeat answered 404. Now every
    store is asked first, and a store down fails the write with nothing changed."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.open import open_retriever
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.service import documents

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "memo", "title": "Memo", "text": "quokka memo"}) + "\n")
    settings = load_settings(overrides={"home": tmp_path / "home", "index": "w"},
                             read_env=False, read_file=False)
    ingest(corpus, settings, dense=False)
    r = open_retriever(settings, need_dense=False)
    try:
        def down(*args, **kwargs):
            raise BackendUnavailable("elasticsearch at http://es:9200 is not reachable")

        lexical = r.lexical
        lexical.count = lexical.write = down
        with pytest.raises(BackendUnavailable):
            documents.delete(r, settings, "memo")
        assert r.docstore.get_document("memo") is not None  # nothing changed
        del lexical.count, lexical.write  # back up: the repeat deletes it everywhere
        assert documents.delete(r, settings, "memo") is True
        assert r.docstore.get_document("memo") is None
        assert r.search("quokka memo", mode="bm25", k=5) == []
    finally:
        r.close()


def test_keys_cli_finds_the_keys_file_by_home(tmp_path):
    """`keys` had no --home: a key made for `serve --home H` went to ./.branchsearch. Now the
    file is --keys, else HOME/keys.json (--home, else BRANCHSEARCH_HOME)."""
    import json
    import os
    import subprocess
    import sys
    import unicodedata

    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "keys"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("BRANCHSEARCH_HOME", "BRANCHSEARCH_KEYS")}

    def run(*args, **extra):
        return subprocess.run([*cli, *map(str, args)], capture_output=True, text=True,
                              cwd=tmp_path, env={**env, **extra}, timeout=120)

    home = tmp_path / "home"
    made = run("add", "alice", "--groups", "hr", "--home", home)
    assert made.returncode == 0, made.stderr
    assert str(home / "keys.json") in made.stderr and made.stdout.strip()
    assert not (tmp_path / ".branchsearch").exists()
    listed = run("list", "--json", BRANCHSEARCH_HOME=str(home))
    assert [k["name"] for k in json.loads(listed.stdout)] == ["alice"]
    assert run("revoke", "alice", "--keys", home / "keys.json").returncode == 0
    again = run("list", "--json", "--home", home)
    assert json.loads(again.stdout)[0]["revoked"] is True
    assert json.loads(run("list", "--json").stdout) == []  # ./.branchsearch: another file
    # what it says it made is what it stored (" a ,, b " is stored as a,b)
    spaced = run("add", "spacey", "--groups", " a ,, b ", "--indexes", "x, y", "--home", home)
    assert "(groups: a,b; indexes: x,y)" in spaced.stderr, spaced.stderr
    assert "groups: none — public documents only" in run("add", "bare", "--home", home).stderr
    decomposed = run("add", unicodedata.normalize("NFD", "schlüssel"), "--home", home)
    assert decomposed.returncode == 0 and "key 'schlüssel' added" in decomposed.stderr, \
        decomposed.stderr


def test_a_wrapped_upload_says_what_the_body_must_be():
    """`{"documents": [...]}` used to be read as one JSONL line: 'body:1: missing document id',
    though each document had one (found by a hostile pass)."""
    from branchsearch.infra.errors import CorpusError
    from branchsearch.orchestrator.service.documents import parse_documents

    with pytest.raises(CorpusError, match="one JSON object holding 'documents'.*JSON array"):
        parse_documents(json.dumps({"documents": [{"_id": "a", "text": "x"}]}).encode())
    assert [d.id for d in parse_documents(b'{"id": "a", "text": "x"}')] == ["a"]  # JSONL
    assert [d.id for d in parse_documents(b'[{"id": "a", "text": "x"}]')] == ["a"]
    with pytest.raises(CorpusError, match="body:1: missing document id"):
        parse_documents(b'{"text": "no id", "tags": ["t"]}')  # a list, but a document's


def test_an_upload_naming_a_key_twice_is_refused():
    """A document in an upload that gives `id` (or any key) twice was written under the last
    one; as a JSON array or as JSONL, the body is refused (422) naming the key."""
    from branchsearch.infra.errors import CorpusError
    from branchsearch.orchestrator.service.documents import parse_documents
    from branchsearch.orchestrator.service.errors import api_error

    for body, where in ((b'[{"id": "a", "text": "x"}, {"id": "b", "id": "c", "text": "y"}]',
                         "body element 2 of 2: "),
                        (b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y", "text": "z"}\n',
                         "body:2: ")):
        with pytest.raises(CorpusError, match=f"{where}the key '(id|text)' is given twice") as exc:
            parse_documents(body)
        assert api_error(exc.value).status == 422


def test_a_keys_file_that_is_a_folder_is_one_operator_error(tmp_path):
    """A folder given as the keys file was a traceback in `keys` and a 500 in the service."""
    folder = tmp_path / "keys.json"
    folder.mkdir()
    with pytest.raises(KeysFileError, match="cannot be read"):
        KeyStore(folder).list()
    assert api_error(KeysFileError("x")).status == 503


def test_a_keys_file_gone_under_a_server_is_an_operator_error_not_unknown_keys(tmp_path):
    """A server's keys file moved away: every key, valid or not, is refused as the server's
    fault (503 keys_unavailable), never told its key is unknown; `keys add` still makes a
    new file where there is none."""
    store = KeyStore(tmp_path / "keys.json")
    key = store.add("alice", ("g",))
    assert store.authenticate(key).name == "alice"
    (tmp_path / "keys.json").rename(tmp_path / "keys.moved")
    with pytest.raises(KeysFileError, match="is gone"):
        store.authenticate(key)
    with pytest.raises(AuthError, match="missing API key"):
        store.authenticate(None)  # no key at all is still the caller's 401
    assert KeyStore(tmp_path / "new.json").add("bob", ("g",))


def test_an_index_that_changed_on_disk_is_reopened_once_its_requests_end(tmp_path):
    """A running service kept the stores it opened: after an ingest in another process that
    changed the index's layout it ranked with the old stores under a policy that read the new
    manifest; after the folder was removed and ingested anew it searched the deleted files; an
    index left incomplete by a failed ingest it went on searching.
    Now the next request reopens the index: requests using the old driver finish on it, its
    stores are closed, then the new ones open (or the index's problem is the answer). An ingest
    under way, or one that only added documents, keeps the driver."""
    import shutil
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.errors import IndexIncomplete
    from branchsearch.infra.index.manifest import (IngestLock, Manifest, remove_manifest,
                                                   write_manifest)
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="x").index_dir
    folder.mkdir(parents=True)
    (folder / "docs.sqlite").touch()
    hybrid = dict(documents=2, chunks={}, embedding={"model": "m", "dim": 4},
                  encoding="o200k_base", chunk_tokens=256, chunk_overlap=32,
                  backends={})  # (no store files to check)
    write_manifest(folder, Manifest(**hybrid))
    log: list[str] = []

    def then(manifest: dict) -> None:
        time.sleep(0.01)  # a new mtime, whatever the clock's grain
        write_manifest(folder, Manifest(**manifest))

    searcher = Searcher(settings, executor="local",
                        driver_factory=lambda s, executor: FakeDriver(len(log), log))
    first = searcher.drivers.open("x")
    with searcher.drivers.using("x") as (driver, _):  # a request in flight on the old driver
        assert driver is first
        with IngestLock(folder, "x"):  # an ingest under way ...
            remove_manifest(folder)
            assert searcher.drivers.open("x") is first
            then({**hybrid, "documents": 3})  # ... that adds a document
        assert searcher.drivers.open("x") is first
        then({**hybrid, "embedding": None})  # another layout
        with pytest.raises(ApiError) as caught:  # the reopen waits for the request
            searcher.drivers.open("x", wait=0.2)
        assert caught.value.status == 503 and caught.value.body()["error"] == "index_starting"
        assert log == ["open 0"]  # not closed under the request
    second = searcher.drivers.open("x", wait=10)
    assert second is not first and log == ["open 0", "close 0", "open 2"]
    assert searcher.drivers.open("x") is second

    store = folder / "docs.sqlite"
    with open(store):  # held open (as the searcher's docstore holds it: no inode reuse)
        shutil.rmtree(folder)  # removed, and ingested anew with the same layout
        folder.mkdir(parents=True)
        store.touch()
        then({**hybrid, "embedding": None})
        third = searcher.drivers.open("x", wait=10)
    assert third is not second and log[-2:] == ["close 2", "open 4"]

    shutil.rmtree(folder)  # removed: not found, and its stores closed
    with pytest.raises(IndexNotFound):
        searcher.drivers.open("x", wait=10)
    waited = time.monotonic()
    while log[-1] != "close 4":
        assert time.monotonic() - waited < 10, log
        time.sleep(0.01)
    folder.mkdir(parents=True)
    store.touch()
    then(hybrid)
    assert searcher.drivers.open("x", wait=10) and log[-1] == "open 6"
    remove_manifest(folder)  # an ingest that failed: no manifest, no ingest under way
    with pytest.raises(IndexIncomplete):
        searcher.drivers.open("x", wait=10)
    waited = time.monotonic()
    while log[-1] != "close 6":  # (answered before its stores close, as a removed index is)
        assert time.monotonic() - waited < 10, log
        time.sleep(0.01)
    assert "x" not in searcher.drivers.by_index
    searcher.close()


def test_the_schemas_index_name_pattern_takes_every_name_the_service_takes():
    """A client that checks names against /openapi.json never refuses a name the service
    accepts (any script's letters and digits), and refuses what the service refuses in ASCII
    and whitespace."""
    import re

    from branchsearch.infra.config.settings import index_name_problem
    from branchsearch.orchestrator.service.protocol import INDEX_NAME_PATTERN

    taken = ["hotpot", "a_b-1", "índice-ü", "日本語", "Ωmega", "_-x_", "٣", "x" * 100]
    refused = ["a b", "a.b", "-_", "a/b", "a\\b", "a#b", "a%b", "a?b", "a\tb", "é\u00a0b",
               "\u2003", "a:b", "a\x00b"]
    for name in taken:
        assert not index_name_problem(name), name
        assert re.search(INDEX_NAME_PATTERN, name), name
    for name in refused:
        assert index_name_problem(name), name
        assert not re.search(INDEX_NAME_PATTERN, name), name


def test_keys_commands_run_at_once_lose_nothing_and_a_revoke_sticks(tmp_path):
    """Eight `keys add` and one `keys revoke` started together, as separate processes: every
    added key is in the file and the revoked one stays revoked: each command reads, changes and
    writes the whole file under a lock between processes, with a temp file of its own."""
    import subprocess
    import sys

    keys = tmp_path / "keys.json"
    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "keys"]
    assert subprocess.run([*cli, "add", "victim", "--keys", keys],
                          capture_output=True).returncode == 0
    for round_ in range(2):
        procs = [subprocess.Popen([*cli, "add", f"k{round_}-{i}", "--keys", keys],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(8)]
        if round_ == 0:
            procs.append(subprocess.Popen([*cli, "revoke", "victim", "--keys", keys],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()[-500:]
    listed = {k.name: k.revoked for k in KeyStore(keys).list()}
    assert listed == {"victim": True, **{f"k{r}-{i}": False for r in range(2) for i in range(8)}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.json.lock"]


def test_a_password_with_a_raw_at_sign_is_masked_whole(tmp_path):
    """`http://user:Es@Pass@9931@host` is read by URL clients as password `Es@Pass@9931`: the
    whole userinfo, to the last '@', is masked. A per-index URL's password is a registered
    secret too, masked wherever it appears alone."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.errors import public_line, redact

    line = "elasticsearch at http://esuser:Es@Pass@9931@127.0.0.1:1 is not reachable"
    assert redact(line) == "elasticsearch at http://***@127.0.0.1:1 is not reachable"
    assert "Pass" not in public_line(line)
    config = tmp_path / "s.toml"
    config.write_text('[indexes.extes]\nlexical = "elasticsearch"\nes_index = "corp"\n'
                      'es_url = "http://esuser:Zq7%40Word-x1@127.0.0.1:1"\n'
                      '[indexes.extmv]\ndense = "milvus"\nmilvus_collection = "c"\n'
                      'milvus_uri = "http://mv:Mv-Secret-77@127.0.0.1:2"\n')
    load_settings(config, {"index": "extes"}, read_env=False)
    assert redact("auth failed for Zq7@Word-x1 and Mv-Secret-77") == "auth failed for *** and ***"


def test_keys_written_through_a_symlink_change_its_target(tmp_path):
    """A keys file that is a symlink (a secrets mount, a shared config): `keys add` and
    `keys revoke` change the file it points to and leave the link a link."""
    (tmp_path / "real").mkdir()
    link = tmp_path / "keys.json"
    link.symlink_to(tmp_path / "real" / "keys.json")
    KeyStore(link).add("alice", ("g",))
    KeyStore(tmp_path / "real" / "keys.json").add("bob", ("g",))
    KeyStore(link).revoke("alice")
    assert link.is_symlink()
    assert {k.name: k.revoked for k in KeyStore(tmp_path / "real" / "keys.json").list()} == {
        "alice": True, "bob": False}
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["keys.json",
                                                                     "keys.json.lock"]


def test_a_burst_at_a_starting_index_is_answered_by_each_deadline(tmp_path):
    """40 searches at once, deadline 1 s, at an index whose start takes longer: each answers
    503 index_starting about 1 s after it arrived, however few threads asyncio's default pool
    has (the deadline counts from arrival, and every admitted request has a thread)."""
    import asyncio
    import time

    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.auth import ApiKey
    from branchsearch.orchestrator.service.admission import Limits
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="late").index_dir
    folder.mkdir(parents=True)
    (folder / "docs.sqlite").touch()
    write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    release = threading.Event()

    def factory(s, executor):
        release.wait(30)
        raise IndexNotFound("gone")

    searcher = Searcher(settings, executor="local", driver_factory=factory,
                        limits=Limits(per_key_concurrency=64))
    key = ApiKey("k", ("*",), (), True, "", False, "d")

    async def one(i: int) -> float:
        began = time.perf_counter()
        req = parse_search({"question": f"harbor {i}", "index": "late", "deadline_s": 1},
                           Limits())
        with pytest.raises(ApiError) as caught:
            await searcher.search(req, key)
        assert caught.value.body()["error"] == "index_starting"
        return time.perf_counter() - began

    async def burst() -> list[float]:
        return await asyncio.gather(*(one(i) for i in range(40)))

    try:
        waited = asyncio.run(burst())
    finally:
        release.set()
        searcher.close()
    assert max(waited) < 3, sorted(waited)


def test_metrics_of_several_replicas_merge():
    """What a scrape of one ingress replica shows with the others' snapshots: counters,
    histograms and in-flight requests summed; the searcher's gauges (every replica reads them
    when scraped) as the scraped replica read them, not the largest: another replica's is as
    old as its last scrape, and the count of searches past their deadline goes down (before,
    a stale 60 stayed once the backend recovered); a counter's creation time the earliest."""
    from prometheus_client.parser import text_string_to_metric_families

    from branchsearch.orchestrator.service.metrics import ServiceMetrics

    a, b = ServiceMetrics(), ServiceMetrics()
    for m, statuses in ((a, [200, 200]), (b, [200, 429])):
        for status in statuses:
            m.observe_request("/v1/search", "POST", status, 0.5)
        m.in_flight.inc()
        m.acl_guard_dropped.set(3)
    a.searches_past_deadline.set(0)  # read now: the backend recovered
    b.searches_past_deadline.set(60)  # read at b's last scrape, while it hung
    merged = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(a.render([b.snapshot()]).decode())
              for s in f.samples}
    search = (("endpoint", "/v1/search"), ("method", "POST"))
    assert merged[("branchsearch_http_requests_total", search + (("status", "200"),))] == 3
    assert merged[("branchsearch_http_requests_total", search + (("status", "429"),))] == 1
    assert merged[("branchsearch_http_request_duration_seconds_sum",
                   search + (("status", "200"),))] == 1.5
    assert merged[("branchsearch_http_requests_in_flight", ())] == 2
    assert merged[("branchsearch_acl_guard_dropped_ids", ())] == 3
    assert merged[("branchsearch_searches_past_deadline", ())] == 0
    created = ("branchsearch_http_requests_created", search + (("status", "200"),))
    own = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(a.render().decode()) for s in f.samples}
    assert merged[created] == min(own[created], merged[created])
    assert a.render([]) == a.render()  # alone: its own text


def test_serve_proxies_go_where_their_address_is():
    """On a cluster Serve starts an HTTP proxy per node; a proxy told to listen on one node's
    own address cannot bind it elsewhere (Serve would restart that proxy over and over), so
    one address means the head only."""
    from branchsearch.orchestrator.service.deploy import proxy_location

    for host in ("0.0.0.0", "::", "127.0.0.1", "::1", "localhost"):
        assert proxy_location(host) == "EveryNode", host
    for host in ("10.93.0.1", "192.168.1.20", "fe80::1", "search.corp.example"):
        assert proxy_location(host) == "HeadOnly", host


def test_a_stream_whose_searcher_dies_ends_with_an_error_event():
    """A streamed search whose searcher replica is lost mid-way (its node died: the ingress
    gets an ActorDied-like error after the 200 went out) ends with an `error` event naming
    503 searcher_unavailable, counted as such, instead of a cut connection."""
    import asyncio

    from branchsearch.orchestrator.service.app import STREAM_STATUS, _frames, _unwrap
    from branchsearch.orchestrator.service.events import parse_sse
    from branchsearch.orchestrator.service.metrics import ServiceMetrics

    class ActorDiedError(Exception):  # the name Ray's error carries
        pass

    async def events():
        yield {"type": "branch_started", "branch": 0}
        raise _unwrap(ActorDiedError("the actor died unexpectedly"))

    async def read() -> str:
        source = events()
        first = await source.__anext__()
        return "".join([frame async for frame in _frames(first, source, metrics, scope)])

    metrics, scope = ServiceMetrics(), {}
    frames = parse_sse(asyncio.run(read()))
    assert [f["type"] for f in frames] == ["branch_started", "error"]
    assert frames[-1]["status"] == 503 and frames[-1]["error"] == "searcher_unavailable"
    assert scope[STREAM_STATUS] == 503  # the request is counted under 503, not 200
    assert b'branchsearch_refusals_total{reason="searcher_unavailable"} 1.0' in metrics.render()


def test_an_index_made_anew_while_its_driver_starts_is_not_served_from_two_folders(tmp_path):
    """The service's docstore (a write's ownership check, the ACL guard) and the driver's stores
    must be one folder's, or a scoped admin's write is checked against one index and lands in
    another. A start whose index changed on disk meanwhile is a 503 to retry, nothing held; the
    next start serves the new folder alone."""
    import shutil

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.orchestrator.service.drivers import Drivers
    from branchsearch.orchestrator.service.errors import ApiError

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="race").index_dir
    layout = dict(documents=2, chunks={}, embedding=None, encoding="o200k_base",
                  chunk_tokens=256, chunk_overlap=32, backends={})

    def make_folder() -> None:
        folder.mkdir(parents=True)
        (folder / "docs.sqlite").touch()
        write_manifest(folder, Manifest(**layout))

    make_folder()
    log, anew = [], [True]

    def make(s):
        if anew and anew.pop():  # removed and ingested anew while the driver starts
            shutil.rmtree(folder)
            make_folder()
        return FakeDriver(len(log), log)

    closed = []
    drivers = Drivers(settings, make=make,
                      close=lambda d, store: (d.close(), store.close(), closed.append(store)))
    with pytest.raises(ApiError) as caught:
        drivers.open("race", wait=10)
    assert caught.value.status == 503 and caught.value.body()["error"] == "index_starting"
    assert "changed on disk while it was starting" in caught.value.detail
    assert log == ["open 0", "close 0"] and len(closed) == 1 and "race" not in drivers.by_index
    again = drivers.open("race", wait=10)
    assert again.n == 2 and drivers.by_index["race"] is again and log[-1] == "open 2"
    drivers.close()

    def gone(s):  # the index removed while its driver started: the driver's own error names
        raise IndexNotFound(f"index 'race' not found under {tmp_path} (run `…`)")  # the home

    with pytest.raises(IndexNotFound) as caught:
        Drivers(settings, make=gone, close=lambda d, store: None).open("race", wait=10)
    assert str(tmp_path) not in str(caught.value) and "make it with" in str(caught.value)


def test_the_limits_are_settings_a_serve_config_goes_over(tmp_path, monkeypatch):
    """The service's limits are the settings' `[service]` section (a file, the environment),
    in both serve modes; a Ray Serve config's `limits` go over them; one default."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.errors import SettingsError

    path = tmp_path / "b.toml"
    path.write_text("[service]\nper_key_concurrency = 2\nindex_idle_close_s = 30\n")
    monkeypatch.setenv("BRANCHSEARCH_MAX_K", "20")
    # a k past final_k (what a search returns, 10) could not be honoured: max_k <= it
    assert Limits.of(load_settings(path)).max_k == 10
    monkeypatch.setenv("BRANCHSEARCH_FINAL_K", "30")
    settings = load_settings(path)
    limits = Limits.of(settings)
    assert (limits.per_key_concurrency, limits.index_idle_close_s, limits.max_k) == (2, 30.0, 20)
    assert Limits.of(settings, per_key_concurrency=6).per_key_concurrency == 6  # the config's
    assert Limits() == Limits.of(load_settings(read_env=False, read_file=False))  # one default
    gate = Concurrency(limits)
    with gate.slot("k"), gate.slot("k"):
        with pytest.raises(ApiError) as caught:
            with gate.slot("k"):
                pass
    assert caught.value.status == 429
    path.write_text("[service]\nper_key_concurrency = 0\n")
    with pytest.raises(SettingsError, match=r"per_key_concurrency .*>= 1 \(set by settings file"):
        load_settings(path)
    path.write_text("[agent]\nper_key_concurrency = 3\n")
    with pytest.raises(SettingsError, match=r"it belongs in \[service\]"):
        load_settings(path)
    path.write_text("[service]\nmax_open_indexes = 3\n")  # the open-index cap, one default
    assert Limits.of(load_settings(path)).max_open_indexes == 3 and Limits().max_open_indexes == 8
    for bad, said in (("0", r"^bad settings: max_open_indexes must be >= 1 \(set by "
                       r"BRANCHSEARCH_MAX_OPEN_INDEXES\)$"),
                      ("eight", "cannot read 'eight' as int")):
        monkeypatch.setenv("BRANCHSEARCH_MAX_OPEN_INDEXES", bad)
        with pytest.raises(SettingsError, match=said):
            load_settings(path)
    monkeypatch.delenv("BRANCHSEARCH_MAX_OPEN_INDEXES")
    # a Ray Serve config's `limits` are checked as the settings are: 0 was taken as "no cap"
    for changes, said in (({"max_open_indexes": 0}, r"max_open_indexes must be >= 1"),
                          ({"per_key_concurrency": "two"}, "cannot read 'two' as int"),
                          ({"max_open_index": 2}, r"'max_open_index' is not a limit"),
                          ({"search_mode": "bm25"}, r"'search_mode' is not a limit")):
        with pytest.raises(SettingsError, match=said):
            Limits.of(settings, **changes)


def test_a_start_waited_for_again_gets_only_what_is_left_of_the_wait(tmp_path):
    """`Drivers.using(index, wait)`: when the driver it waited for was retired before the request
    could hold it (its index changed on disk), the next start was waited for with the whole
    `wait` again, so a request could overrun its deadline by one start. The wait now bounds the
    whole: the second start gets what is left."""
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.orchestrator.service.drivers import Drivers

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    waits: list[float | None] = []
    retire = [True]

    class Retiring(Drivers):
        def open(self, index, wait=None):
            waits.append(wait)
            return object()

        def hold(self, index, driver):
            if retire and retire.pop():  # retired meanwhile, after a start that took 0.3 s
                time.sleep(0.3)
                return None
            return (None,)

        def let_go(self, driver, index):
            pass

    drivers = Retiring(settings, make=lambda s: None, close=lambda d, s: None)
    with drivers.using("x", wait=0.5):
        pass
    assert len(waits) == 2 and 0.49 < waits[0] <= 0.5 and 0 <= waits[1] <= 0.2 + 1e-3
    waits.clear()
    retire.append(True)
    with drivers.using("x"):  # no wait given: none either time
        pass
    assert waits == [None, None]


def test_readiness_answers_within_its_wait_and_probes_share_one_check():
    """Every probe waits at most `wait_s` (a backend that stopped answering would hold a check
    for its whole timeout), and the probes that arrive while a check hangs share the one check
    after it: a frozen backend holds one thread, whatever the number of probes. Once it
    answers, the check that waited runs at once."""
    import time

    from branchsearch.orchestrator.service.readiness import SharedCheck, Unanswered

    release, runs = threading.Event(), []

    def check():
        runs.append(1)
        if not release.wait(30):
            raise AssertionError("never released")
        return {"status": "ready"}

    ready = SharedCheck(check, wait_s=0.2)
    answers: list = []

    def probe():
        began = time.monotonic()
        try:
            answers.append(ready())
        except Unanswered as exc:
            answers.append(exc)
        answers.append(time.monotonic() - began)

    probes = [threading.Thread(target=probe) for _ in range(6)]
    for t in probes:
        t.start()
    for t in probes:
        t.join(10)
    told = [a for a in answers if isinstance(a, Unanswered)]
    assert len(told) == 6 and "not ended within 0.2 s" in str(told[0])
    assert max(a for a in answers if isinstance(a, float)) < 5  # not the backend's timeout
    assert len(runs) == 1  # the check that hangs; the next one waits for it
    assert len([t for t in threading.enumerate() if t.name.startswith("readiness")]) == 1
    release.set()
    deadline = time.monotonic() + 10
    while len(runs) < 2:  # the check the probes waited for runs once the first has ended
        assert time.monotonic() < deadline, "the waiting check did not run"
        time.sleep(0.01)
    assert ready() == {"status": "ready"} and len(runs) == 3  # begun after this probe
    ready.close()


def test_a_server_is_asked_once_for_the_indexes_on_it_while_its_answer_is_fresh():
    """The probes of many indexes on one server (`reachable.Servers`): those that come while
    its question is under way wait for it (the server is asked once, not once an index), a
    success is given again for `fresh_s`, an error raised to each, and the server is asked
    anew after that."""
    import threading
    import time

    from branchsearch.infra.errors import BackendUnavailable
    from branchsearch.orchestrator.service.reachable import Servers

    asked, down = [], [False]

    def ask():
        asked.append(time.monotonic())
        time.sleep(0.3)
        if down[0]:
            raise BackendUnavailable("elasticsearch at http://es:9200 is not answering")

    servers = Servers(fresh_s=1.0)
    outcomes = []

    def probe():
        try:
            servers.check(("elasticsearch", "http://es:9200", None), ask)
            outcomes.append(None)
        except BackendUnavailable as exc:
            outcomes.append(str(exc))

    def probes(n):
        threads = [threading.Thread(target=probe) for _ in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)

    probes(8)
    assert len(asked) == 1 and outcomes == [None] * 8
    servers.check(("milvus", "http://mv:19530"), ask)  # another server: asked
    assert len(asked) == 2
    down[0] = True
    probes(4)  # within fresh_s: the answer of before
    assert len(asked) == 2 and outcomes[8:] == [None] * 4
    time.sleep(1.0)
    probes(4)
    assert len(asked) == 3
    assert outcomes[12:] == ["elasticsearch at http://es:9200 is not answering"] * 4

    # a hung server's question (the review's case): a probe that comes later than `fresh_s`
    # after it began asks for itself, and sees the server back, instead of waiting for the
    # hung question and being given its failure
    slow, answers = Servers(fresh_s=0.5), {}

    def hung_then_back():
        if not answers:  # the first question: the server hangs, then fails it
            answers["first"] = time.monotonic()
            time.sleep(1.5)
            raise BackendUnavailable("elasticsearch at http://es:9200 is not answering")

    def probe_slow(name):
        try:
            slow.check(("elasticsearch", "http://es:9200", None), hung_then_back)
            answers[name] = "ready"
        except BackendUnavailable:
            answers[name] = "down"

    first = threading.Thread(target=probe_slow, args=("a",))
    first.start()
    time.sleep(1.0)  # the server is back; the first question still hangs
    probe_slow("b")
    first.join(10)
    assert answers["a"] == "down" and answers["b"] == "ready", answers


def test_a_readiness_probe_is_answered_by_a_check_begun_after_it():
    """A probe that arrives while a check runs is not given that check's answer: the check
    looked at the backends before the probe came, and a backend that died (or recovered)
    since would go unseen. The probe waits for the next check, within `wait_s`."""
    import time

    from branchsearch.orchestrator.service.readiness import SharedCheck

    backend, looked, release = {"up": True}, threading.Event(), threading.Event()

    def check():
        up = backend["up"]  # what the backend says when the check looks
        looked.set()
        release.wait(30)
        return up

    ready = SharedCheck(check, wait_s=30)
    answers: dict = {}
    first = threading.Thread(target=lambda: answers.update(first=ready()))
    first.start()
    assert looked.wait(30)
    backend["up"] = False  # the backend dies after the running check looked at it
    second = threading.Thread(target=lambda: answers.update(second=ready()))
    second.start()
    time.sleep(0.5)  # the second probe arrives while the first check still runs
    release.set()
    first.join(30)
    second.join(30)
    assert answers == {"first": True, "second": False}
    ready.close()


def test_a_frozen_index_other_than_the_default_is_waited_for_once(tmp_path):
    """An index other than the default whose backend froze is given `OTHERS_WAIT_S` from the
    check's start, once: the checks after the first count it not ready at once rather than
    waiting for the same stuck probe again, so a probe that waits for the check after the
    running one is still answered within its wait."""
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.orchestrator.service.searcher import OTHERS_WAIT_S, Searcher

    settings = load_settings(overrides={"home": tmp_path, "index": "main"}, read_env=False,
                             read_file=False)
    for name in ("main", "frozen"):
        folder = settings.replace(index=name).index_dir
        folder.mkdir(parents=True)
        (folder / "docs.sqlite").touch()
        write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    thaw = threading.Event()

    class Driver:
        """Its retriever's one store answers `count` (a probe) at once, or once thawed."""

        def __init__(self, s, executor):
            self.executor = self.retriever = self.lexical = self
            self.dense, self.index = None, s.index

        def count(self):
            if self.index == "frozen":
                thaw.wait(60)
            return 1

        def close(self):
            pass

    searcher = Searcher(settings, executor="local", driver_factory=Driver)
    searcher.drivers.open("frozen")
    frozen = [{"index": "frozen", "error": "backend_unavailable"}]
    try:
        began = time.monotonic()
        assert searcher._ready_now() == {"status": "ready", "indexes": 2,
                                         "indexes_not_ready": 1, "not_ready": frozen}
        assert time.monotonic() - began >= OTHERS_WAIT_S - 0.1  # the first check waits
        began = time.monotonic()
        assert searcher._ready_now() == {"status": "ready", "indexes": 2,
                                         "indexes_not_ready": 1, "not_ready": frozen}
        assert time.monotonic() - began < OTHERS_WAIT_S / 2  # the next one does not
    finally:
        thaw.set()
        searcher.close()


def test_index_probes_run_a_few_at_a_time_and_keep_their_answers_a_while():
    """`IndexProbes`: however many indexes, at most `workers` probes run at once; an answer is
    given again within `fresh_s` with no probe run; a check waits for the probes it started
    until its `until`, then gives `Pending` for one not ended, and a probe that has run
    `slow_s` is `Pending` whatever it answered before."""
    import time

    from branchsearch.orchestrator.service.readiness import IndexProbes, Pending

    probes = IndexProbes(workers=2, fresh_s=60, slow_s=0.5)
    lock, running, peak, calls, thaw = threading.Lock(), [0], [0], [], threading.Event()

    def probe(name):
        def run():
            with lock:
                calls.append(name)
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            try:
                if name == "frozen":
                    thaw.wait(30)
                    raise OSError("frozen")
                time.sleep(0.02)
            finally:
                with lock:
                    running[0] -= 1
        return run

    asked = {f"i{n}": probe(f"i{n}") for n in range(12)}
    try:
        answers = probes.answers(probes.start(asked), time.monotonic() + 10)
        assert answers == {k: None for k in asked} and peak[0] <= 2, peak
        assert probes.answers(probes.start(asked), time.monotonic()) == answers
        assert len(calls) == 12  # fresh: none run again
        began = time.monotonic()
        frozen = {"frozen": probe("frozen")}
        assert probes.answers(probes.start(frozen), began + 0.2) == {"frozen": Pending}
        assert 0.2 <= time.monotonic() - began < 1
    finally:
        thaw.set()
        probes.close()


def test_a_search_s_probe_is_shared_and_not_queued_behind_the_checks_probes():
    """`IndexProbes.probing`, the probe of a search that failed or found nothing: the searches
    that ask while one runs share it (one run), it starts at once even when every worker is
    held by a frozen check's probe, its outcome is the exception its probe raised (None:
    ready), and a check that comes while it runs waits for it instead of probing again."""
    import time

    from branchsearch.orchestrator.service.readiness import IndexProbes

    probes = IndexProbes(workers=1, fresh_s=60, slow_s=10)
    calls, thaw, release = [], threading.Event(), threading.Event()

    def frozen():
        thaw.wait(30)

    def slow():
        calls.append("slow")
        release.wait(30)

    def down():
        raise OSError("backend down")

    try:
        probes.start({"frozen": frozen})  # holds the only worker
        began = time.monotonic()
        first, second = probes.probing("x", slow), probes.probing("x", slow)
        assert first is second
        check = probes.start({"x": lambda: calls.append("check")})  # waits for the search's
        assert check["x"] is first
        release.set()
        assert first.result(timeout=5) is None and time.monotonic() - began < 2
        assert calls == ["slow"]
        assert probes.answers(check, time.monotonic() + 1) == {"x": None}
        failed = probes.probing("y", down).result(timeout=5)
        assert isinstance(failed, OSError) and str(failed) == "backend down"
        again = probes.probing("x", slow)  # one that ended is not given again: a new probe
        assert again is not first and again.result(timeout=5) is None
        assert calls == ["slow", "slow"]
    finally:
        thaw.set()
        release.set()
        probes.close()


def test_a_closing_service_starts_no_driver_and_closes_the_one_starting(tmp_path):
    """Once `Drivers.close` has begun, an open is refused (503 shutting_down: JSON to the
    caller) and starts nothing, and a driver still starting when close began is closed when
    its start ends: none is left open to leak its connections or actors. Close waits for that
    start (within its `wait_s`)."""
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.orchestrator.service.drivers import Drivers

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    for name in ("slow", "other"):
        folder = settings.replace(index=name).index_dir
        folder.mkdir(parents=True)
        (folder / "docs.sqlite").touch()
        write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    log, entered, release = [], threading.Event(), threading.Event()

    def make(s):
        if s.index == "slow":
            entered.set()
            release.wait(30)
        return FakeDriver(f"{s.index}-{len(log)}", log)

    drivers = Drivers(settings, make=make,
                      close=lambda d, store: (d.close(), store and store.close()))
    answers: dict = {}

    def open_slow():
        try:
            answers["slow"] = drivers.open("slow", wait=30)
        except ApiError as exc:
            answers["slow"] = exc

    starting = threading.Thread(target=open_slow)
    starting.start()
    assert entered.wait(30)
    closing = threading.Thread(target=drivers.close, kwargs={"wait_s": 30})
    closing.start()
    deadline = time.monotonic() + 10
    while True:  # (before close begins, this opens a driver that close closes)
        try:
            drivers.open("other", wait=10)
        except ApiError as exc:
            refused = exc
            break
        assert time.monotonic() < deadline, "an open after close() began was not refused"
        time.sleep(0.01)
    assert (refused.status, refused.error) == (503, "shutting_down")
    assert refused.headers == {"Retry-After": "5"}
    assert closing.is_alive()  # waiting for the start under way
    # the caller waiting on that start is answered now, not when the start ends: a start
    # stuck on a backend held a stopping server's request thread until the backend timed out
    starting.join(5)
    assert not starting.is_alive(), "a caller waiting on a start was not told of the close"
    release.set()
    closing.join(30)
    starting.join(30)
    assert not closing.is_alive() and not starting.is_alive()
    assert isinstance(answers["slow"], ApiError) and answers["slow"].error == "shutting_down"
    opened = [line.split(" ", 1)[1] for line in log if line.startswith("open ")]
    closed = [line.split(" ", 1)[1] for line in log if line.startswith("close ")]
    assert any(n.startswith("slow") for n in opened) and sorted(opened) == sorted(closed), log
    assert drivers.by_index == {}


def test_a_client_gone_while_the_server_drains_is_counted_499(caplog):
    """A request cancelled before its answer began is one whose client left (Ray Serve's proxy
    cancels it then, draining or not): counted 499, answered nothing. So is one whose
    `receive` fails (Serve's call back to its proxy for the body, cancelled with the request)
    — not a 500 with a traceback. Only a server whose grace for requests in flight ran out
    (`cut_off`) answers its cancelled requests 503 shutting_down. The app is driven as an ASGI
    server drives it."""
    import asyncio
    import logging

    from branchsearch.orchestrator.service.app import SearcherClient, ServiceState, create_app

    class TaskCancelled(Exception):
        """What Serve's `receive` raises once the proxy's call is cancelled (Ray's
        TaskCancelledError)."""

    async def gone(how: str):
        state = ServiceState(SearcherClient(None), None)
        app = create_app(state)
        reading, cut, sent = asyncio.Event(), asyncio.Event(), []

        async def receive():  # the rest of the body never comes: the request is in flight
            reading.set()
            await cut.wait()
            raise TaskCancelled("Task: 6b32 was cancelled.")

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "PUT", "scheme": "http", "path": "/v1/indexes/x/documents",
                 "raw_path": b"/v1/indexes/x/documents", "root_path": "", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        request = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(reading.wait(), 30)
        state.draining = True  # the server stops meanwhile
        if how == "receive fails":
            cut.set()
        else:  # its client left (Serve's proxy) / its grace ran out (uvicorn)
            state.cut_off = how == "cut off"
            request.cancel()
        await asyncio.wait({request})
        return sent, state.metrics.render()

    for how in ("cancelled", "receive fails"):
        with caplog.at_level(logging.WARNING, logger="branchsearch.service"):
            sent, metrics = asyncio.run(gone(how))
        assert sent == [], how
        assert b'method="PUT",status="499"} 1.0' in metrics, how
        assert b'status="500"' not in metrics and b'status="503"' not in metrics, how
        assert not caplog.records, caplog.text  # nothing the server did wrong
    sent, metrics = asyncio.run(gone("cut off"))
    assert sent[0]["status"] == 503 and b'"error":"shutting_down"' in sent[1]["body"]
    assert b'method="PUT",status="503"} 1.0' in metrics


def test_an_index_is_closed_only_once_its_searches_have_ended(tmp_path, caplog):
    """Closing the service waits for the searches still running on an index (a request cut off
    at the end of the shutdown grace runs on in its thread), at most `wait_s`, and leaves an
    index still in use open: sqlite crashes the process when its store is closed under a
    reader. A request's search thread counts as a user until it ends (`also`)."""
    import logging
    import time

    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.manifest import Manifest, write_manifest
    from branchsearch.orchestrator.service.searcher import Searcher

    settings = load_settings(overrides={"home": tmp_path}, read_env=False, read_file=False)
    folder = settings.replace(index="x").index_dir
    folder.mkdir(parents=True)
    (folder / "docs.sqlite").touch()
    write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))

    def searcher(log):
        return Searcher(settings.replace(index="x"), executor="local",
                        driver_factory=lambda s, executor: FakeDriver(len(log), log))

    log: list[str] = []
    first = searcher(log)
    with first.drivers.using("x") as (driver, _):
        closing = threading.Thread(target=first.drivers.close, kwargs={"wait_s": 30})
        closing.start()
        time.sleep(0.3)
        assert log == ["open 0"] and closing.is_alive()  # waits for the request
    closing.join(10)
    assert log == ["open 0", "close 0"]

    log2: list[str] = []
    second = searcher(log2)
    with second.drivers.using("x") as (driver, _):
        second.drivers.also(driver)  # the request's search thread, still running after it
    with caplog.at_level(logging.WARNING, logger="branchsearch.service"):
        second.drivers.close(wait_s=0.2)
    assert log2 == ["open 0"]  # left open under the search
    assert "1 search(es) still running at close; its stores are left open" in caplog.text
    second.drivers.let_go(driver, None)


def test_the_page_base_is_the_root_path_escaped_and_on_this_host():
    """The web page's <base href> comes from the ASGI root_path (the prefix the app is served
    under): percent-encoded, HTML-escaped, ending in "/", and never "//host" (another site's
    base, from which the page would load its script)."""
    from branchsearch.orchestrator.service.app import _page_base

    cases = {"": "/", "/": "/", "/x": "/x/", "/x/": "/x/", "/a b/c": "/a%20b/c/",
             '/x"><script>alert(1)</script>': "/x%22%3E%3Cscript%3Ealert%281%29%3C/script%3E/",
             "//evil.example": "/evil.example/", "/x&y": "/x%26y/"}
    for root, base in cases.items():
        assert _page_base({"root_path": root}) == base, root
    assert _page_base({}) == "/"


def test_an_index_that_cannot_be_searched_closes_no_other_to_make_room(tmp_path):
    """With `max_open_indexes` open, a request for an index left incomplete (an ingest stopped)
    or held by an ingest running closed the least recently used open index to make room, then
    failed its start: each such request closed a healthy index. It is answered before any
    room is made."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index.manifest import IngestLock, Manifest, write_manifest
    from branchsearch.orchestrator.service.drivers import Drivers

    settings = load_settings(overrides={"home": tmp_path, "index": "a"}, read_env=False,
                             read_file=False)
    for name in ("a", "b", "stopped", "ingesting"):
        folder = settings.replace(index=name).index_dir
        folder.mkdir(parents=True)
        (folder / "docs.sqlite").touch()
        if name in ("a", "b", "ingesting"):
            write_manifest(folder, Manifest(**{f: None for f in Manifest.__dataclass_fields__}))
    log: list[str] = []
    drivers = Drivers(settings, make=lambda s: FakeDriver(s.index, log),
                      close=lambda d, store: (d.close(), store and store.close()), max_open=2)
    drivers.open("a", wait=10), drivers.open("b", wait=10)
    with IngestLock(settings.replace(index="ingesting").index_dir, "ingesting"):
        for name, refused in (("stopped", IndexIncomplete), ("ingesting", IndexBusy)):
            with pytest.raises(refused):
                drivers.open(name, wait=10)
    assert sorted(drivers.by_index) == ["a", "b"] and log == ["open a", "open b"]
    assert drivers.open("b", wait=10) is drivers.by_index["b"] and log == ["open a", "open b"]
    drivers.close()


def test_the_readiness_board_answers_for_a_live_searcher_and_not_for_a_silent_one():
    """Under Ray Serve /readyz and GET /v1/indexes answer from the searcher replicas' posts on
    the readiness board (`service.board`): with no post, or only posts older than the bound (a
    searcher gone or wedged), 503 `not_ready` saying so; else a ready replica's answers (a
    search goes to whichever replica is free), the youngest such."""
    from branchsearch.orchestrator.service.board import STALE_S, Published, current

    ready = Published({"status": "ready", "indexes": 1, "indexes_not_ready": 0}, ["acl"])
    down = Published(ApiError(503, "not_ready", "the default index is not ready"), ["acl"])
    for posts, said in (([], "has not published whether it is ready (still starting, or "
                              "gone)"),
                        ([(STALE_S + 1, ready)], f"has not said whether it is ready for "
                                                 f"{STALE_S + 1:.0f} s (gone, or wedged)")):
        with pytest.raises(ApiError) as refused:
            current(posts)
        assert (refused.value.status, refused.value.error) == (503, "not_ready")
        assert refused.value.detail == f"the searcher {said}"
        assert refused.value.headers == {"Retry-After": "5"}
    assert current([(1.0, down), (3.0, ready)]) is ready
    assert current([(1.0, down), (STALE_S + 1, ready)]) is down
    younger = Published({"status": "ready", "indexes": 2, "indexes_not_ready": 0}, ["acl", "b"])
    assert current([(4.0, ready), (0.5, younger)]) is younger
    with pytest.raises(ApiError) as refused:  # the age said is the youngest post's
        current([(86400.0, ready), (STALE_S + 5, down)])
    assert refused.value.detail.endswith(f"for {STALE_S + 5:.0f} s (gone, or wedged)")


def test_the_searchers_figures_a_scrape_reads_from_the_board_sum_the_live_replicas():
    """Under Ray Serve /metrics reads the searcher's figures (the ACL guard's count, the
    searches past their deadline) from the searcher replicas' posts on the readiness board
    (each replica counts its own), not through the searcher's queue: the sum over the posts
    younger than the bound; None (the gauges left as they were) when the board has none."""
    from branchsearch.orchestrator.service.board import STALE_S, Published, gauges

    def figures(dropped, stuck):
        return {"guard_dropped": dropped, "past_deadline": stuck}

    ready = {"status": "ready", "indexes": 1, "indexes_not_ready": 0}
    assert gauges([]) is None
    assert gauges([(STALE_S + 1, Published(ready, ["acl"], figures(7, 1)))]) is None
    assert gauges([(1.0, Published(ready, ["acl"], figures(2, 1))),
                   (3.0, Published(ApiError(503, "not_ready", "x"), ["acl"], figures(3, 0))),
                   (STALE_S + 1, Published(ready, ["acl"], figures(100, 9)))]) == \
        figures(5, 1)


def test_the_readiness_board_forgets_a_replica_that_died_without_withdrawing(monkeypatch):
    """A searcher replica killed (OOM, its node lost) never withdraws its post; the board drops
    a post gone stale at the next post of any replica, so it holds no more than the replicas
    of the last `STALE_S`, and a dead replica's "ready" never outlives that bound."""
    from branchsearch.orchestrator.service import board

    clock = [1000.0]
    monkeypatch.setattr(board.time, "monotonic", lambda: clock[0])
    posts = board.ReadinessBoard()
    ready = board.Published({"status": "ready", "indexes": 1, "indexes_not_ready": 0}, ["acl"])
    for n in range(50):  # fifty replicas that came and died, one after another
        posts.post(f"dead-{n}", ready)
        clock[0] += board.STALE_S / 10
    posts.post("live", ready)
    assert len(posts.read()) <= 11
    clock[0] += board.STALE_S + 1
    posts.post("live", ready)
    assert [age for age, _ in posts.read()] == [0.0]


def test_a_readiness_error_the_board_answers_is_logged_once_while_it_repeats(caplog):
    """The board answers an unexpected error of the readiness check or the index list as 500
    "… (details in the server log)": the log has it with its traceback, once while the same
    error repeats at every post (every 2 s), again when it changes or after it cleared."""
    from branchsearch.orchestrator.service.board import answered

    met = [PermissionError("[Errno 13] Permission denied: 'indexes'")]

    def names():
        if met[0] is None:
            return ["acl"]
        raise met[0]

    logged: dict = {}
    with caplog.at_level("ERROR", logger="branchsearch.service"):
        for _ in range(5):
            refused = answered(names, Exception, logged=logged)
            assert isinstance(refused, ApiError) and refused.status == 500
            assert "details in the server log" in refused.detail
        met[0] = None
        assert answered(names, Exception, logged=logged) == ["acl"]
        met[0] = PermissionError("[Errno 13] Permission denied: 'indexes'")
        answered(names, Exception, logged=logged)
    lines = [r for r in caplog.records if r.name == "branchsearch.service"]
    assert len(lines) == 2 and all(r.exc_info for r in lines)
    assert "Permission denied" in lines[0].getMessage()


def test_a_probe_of_an_unopened_index_reads_its_manifest_once(tmp_path, monkeypatch):
    """A readiness probe of an index no request has opened (`reachable.check_unopened` on its
    profile) read the index's manifest twice: once for where its vectors live, once for its
    profile (a third time for an index on a Milvus server). Once, now: a service with many
    indexes probes each every 2 s."""
    from branchsearch.infra.config.settings import load_settings
    from branchsearch.infra.index import manifest
    from branchsearch.infra.index.profile import index_profile
    from branchsearch.infra.ingest.pipeline import ingest
    from branchsearch.orchestrator.service.reachable import Servers, check_unopened

    from service_fixtures import write_corpus

    settings = load_settings(overrides={"home": tmp_path / "home", "index": "acl"},
                             read_env=False, read_file=False)
    ingest(write_corpus(tmp_path / "corpus.jsonl"), settings, dense=False)
    reads, read = [], manifest.read_manifest
    monkeypatch.setattr(manifest, "read_manifest",
                        lambda *args, **kwargs: reads.append(args) or read(*args, **kwargs))
    check_unopened(settings, index_profile(settings), 3.0, Servers(fresh_s=0.5))
    assert len(reads) == 1, reads
