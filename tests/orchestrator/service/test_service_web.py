"""The web page at / in a real headless Chromium (Debian's `chromium`, driven by Playwright):
paste a key, ask a question, watch the branches, see the evidence with provenance. Document text
is shown as text, never as markup; the same page under a route prefix. Set
BRANCHSEARCH_SCREENSHOT=path to keep the screenshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.infra.config.settings import load_settings
from branchsearch.orchestrator.service import deploy as service
from branchsearch.orchestrator.service.auth import KeyStore

from service_fixtures import LEAK_MARKER, mounted_at, start_uvicorn, write_corpus

CHROMIUM = os.environ.get("BRANCHSEARCH_CHROMIUM", "/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM) or
                                __import__("importlib").util.find_spec("playwright") is None,
                                reason="needs chromium (apt-get install chromium) and playwright")
PREFIX = "/branch/search"  # the app also under a route prefix (two segments)


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    home = tmp_path_factory.mktemp("web-home")
    settings = load_settings(overrides={"home": home, "index": "acl", "branches": 3},
                             read_env=False, read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings)
    store = KeyStore(home / "keys.json")
    keys = {"alpha": store.add("alpha", ("alpha",)), "admin": store.add("admin", ("alpha",),
                                                                        admin=True)}
    state = service.local_state(settings, executor="local", keys_path=home / "keys.json")
    state.searcher.target.drivers.open("acl")
    # at the root, and under PREFIX as Serve's `route_prefix` runs it (ASGI root_path)
    server = start_uvicorn(mounted_at(service.create_app(state), PREFIX, strict=False), state)
    yield server.url, keys
    server.stop()
    state.searcher.target.close()


def test_page_streams_branches_and_renders_evidence(web, tmp_path):
    from playwright.sync_api import sync_playwright

    url, keys = web
    hostile = {"id": "a-markup", "title": "<b id=injected>Harbor</b> sensor <img src=x "
               "onerror=window.pwned=1>", "text": "Harbor sensors report <script>window.pwned=2"
               "</script> lighthouse relay status.", "acl": ["alpha"]}
    r = httpx.put(f"{url}/v1/indexes/acl/documents", json=[hostile],
                  headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=120)
    assert r.status_code == 200, r.text
    shot = Path(os.environ.get("BRANCHSEARCH_SCREENSHOT") or tmp_path / "service_web.png")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            errors, console = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and console.append(m.text))
            page.goto(url + "/")
            # no key yet: the page asks for one instead of calling (and logging a 401)
            page.wait_for_function("document.getElementById('status').textContent"
                                   ".includes('API key')", timeout=30_000)
            assert console == [] and page.inner_text("#who") == "no key"
            _sign_in(page, keys, "alpha")
            # two clauses: the planner launches more than the question's own branch
            page.fill("#question", "What does the Alpha Roadmap plan for harbor sensors and "
                                   "what does the Alpha Budget plan for the lighthouse?")
            page.click("#go")
            page.wait_for_selector("#evidence-list li", timeout=120_000)
            page.wait_for_function("!document.getElementById('go').disabled", timeout=30_000)
            docs = page.locator("#evidence-list li").evaluate_all(
                "els => els.map(e => e.dataset.docId)")
            assert {"a-roadmap", "a-budget"} & set(docs)
            assert not any(d.startswith("b-") for d in docs)
            cards = page.locator(".branch")
            assert cards.count() >= 2
            # each card ran (ok) or was covered by the question's branch, which ranks both
            # documents the clauses name ("Alpha Roadmap", "Alpha Budget"): not run, and said so
            ok, covered = (page.locator(f".branch .badge.{b}").count() for b in ("ok", "covered"))
            assert ok >= 1 and covered >= 1 and ok + covered == cards.count()
            assert "not needed: the question's branch already ranks" in page.inner_text(
                "#branches")
            assert page.locator(".branch .log li.search").count() >= ok
            assert "found by branch" in page.inner_text("#evidence")
            assert page.inner_text("#trace").startswith("trace id ")
            assert "done: ok" in page.inner_text("#status")
            body = page.inner_text("body")
            assert LEAK_MARKER not in body.lower()
            # hostile markup in a document is shown as text, never run or rendered
            assert page.locator("#injected").count() == 0
            assert page.evaluate("window.pwned === undefined")
            if "a-markup" in docs:
                assert "<b id=injected>" in body
            assert errors == [] and console == []
            page.screenshot(path=str(shot), full_page=True)
            # invented words: the dense side's nearest neighbours come back, and the page says
            # they match by meaning only (the result's note), not as if they were evidence
            page.fill("#question", "qwzx plorfing vingledash")
            page.click("#go")
            page.wait_for_selector("#evidence .note", timeout=120_000)
            assert "matched by meaning only" in page.inner_text("#evidence .note")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def test_a_stream_cut_before_its_result_says_so(web):
    """The connection drops after the first events (a proxy, a network): the page says the
    result never came, in red, and no card is left "running" as if it were still working."""
    from playwright.sync_api import sync_playwright

    url, keys = web
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))

            def cut(route):  # the real stream, ended after its first three events
                answer = route.fetch()
                frames = answer.text().split("\n\n")
                assert any('"type": "result"' in f or '"type":"result"' in f for f in frames)
                route.fulfill(response=answer, body="\n\n".join(frames[:3]) + "\n\n")

            page.route("**/v1/search", cut)
            page.goto(url + "/")
            page.fill("#key", keys["alpha"])
            page.click("#savekey")
            page.wait_for_function("document.querySelectorAll('#index option').length > 0",
                                   timeout=30_000)
            page.fill("#question", "What does the Alpha Roadmap plan for harbor sensors?")
            page.click("#go")
            page.wait_for_function("document.getElementById('status').className === 'error'",
                                   timeout=120_000)
            assert "ended before the result" in page.inner_text("#status")
            assert page.locator(".branch .badge", has_text="running").count() == 0
            assert page.locator("#evidence-list").count() == 0
            assert errors == []
        finally:
            browser.close()


def test_the_page_works_under_a_route_prefix(web):
    """Served under a route prefix (Serve's `route_prefix`, a proxy's ASGI `root_path`), the
    page loaded its script and called the API at the host's root (/web/app.js, /v1/whoami):
    outside the application, a 404 where it is deployed, and a dead page. Its paths are now
    relative to a <base> the server sets from root_path: asked for at the prefix, with or
    without the trailing slash, it lists the indexes and searches, every request under it."""
    from playwright.sync_api import sync_playwright

    url, keys = web
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            for asked, search in ((PREFIX + "/", False), (PREFIX, True)):
                page = browser.new_page()
                errors, asks, failed = [], [], []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("request", lambda r: asks.append(r.url))
                page.on("response", lambda r: r.status >= 400 and failed.append(
                    f"{r.status} {r.url}"))
                page.goto(url + asked)
                page.wait_for_function("document.getElementById('status').textContent"
                                       ".includes('API key')", timeout=30_000)
                _sign_in(page, keys, "alpha")
                if search:
                    page.fill("#question", "What does the Alpha Roadmap plan for harbor sensors?")
                    page.click("#go")
                    page.wait_for_selector("#evidence-list li", timeout=120_000)
                    page.wait_for_function("!document.getElementById('go').disabled",
                                           timeout=30_000)
                    assert "done: ok" in page.inner_text("#status")
                    docs = page.locator("#evidence-list li").evaluate_all(
                        "els => els.map(e => e.dataset.docId)")
                    assert "a-roadmap" in docs
                paths = [urlsplit(u).path for u in asks if not u.startswith("data:")]
                assert {PREFIX + "/web/app.js", PREFIX + "/v1/whoami",
                        PREFIX + "/v1/indexes"} <= set(paths), paths
                if search:
                    assert PREFIX + "/v1/search" in paths
                outside = [p for p in paths if p != PREFIX and not p.startswith(PREFIX + "/")]
                assert outside == [] and failed == [] and errors == [], (outside, failed, errors)
                page.close()
        finally:
            browser.close()


def _sign_in(page, keys: dict, name: str) -> None:
    """Save key `name` on the page and wait for the caller's name and the index list (which
    arrives by a request of its own, after or before the name: read before it had in one CI
    run)."""
    page.fill("#key", keys[name])
    page.click("#savekey")
    page.wait_for_function(f"document.getElementById('who').textContent.includes('{name}')",
                           timeout=30_000)
    page.wait_for_function("document.querySelectorAll('#index option').length > 0",
                           timeout=30_000)
    assert page.locator("#index option").all_inner_texts() == ["acl"]
