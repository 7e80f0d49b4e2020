"""`branchsearch serve --address` on a Ray cluster of two nodes (two `ray start`s on this
machine, each with its own CPUs), as the docs run it: where the replicas go, and what callers
see when the worker node dies under a burst. Real Ray, real Serve, real HTTP."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.ingest.pipeline import ingest
from branchsearch.orchestrator.service.auth import KeyStore

from service_fixtures import free_port, write_corpus

pytestmark = pytest.mark.ray
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
ALIVE = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
         "print('alive', sum(1 for n in ray.nodes() if n['Alive']))")


def _node(env: dict, *args: str) -> subprocess.Popen:
    """One `ray start --block` in its own process group (its processes are its children)."""
    return subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1",
                             "--num-gpus=0", "--object-store-memory=100000000",
                             "--disable-usage-stats", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(20)
            return
        except subprocess.TimeoutExpired:
            continue


def _alive(env: dict, address: str) -> int:
    """The cluster's nodes alive, as its GCS counts them (Ray may print warnings on stdout too:
    "raylet has lagging heartbeats" while a node dies)."""
    done = subprocess.run([sys.executable, "-c", ALIVE, address], env=env, capture_output=True,
                          text=True, timeout=120)
    counts = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("alive ")]
    return int(counts[-1]) if done.returncode == 0 and counts else 0


@contextlib.contextmanager
def _cluster(workers: int):
    """A head of 2 CPUs and `workers` worker nodes of 1, with a token of their own; stopped by
    their process groups (never `ray stop`, which stops every cluster on the machine)."""
    temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "BRANCHSEARCH_"))},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    address = f"127.0.0.1:{port}"
    nodes = [_node(env, "--head", f"--port={port}", f"--temp-dir={temp}", "--num-cpus=2",
                   "--include-dashboard=false")]
    try:
        deadline = time.monotonic() + 240
        while _alive(env, address) < 1:
            assert nodes[0].poll() is None and time.monotonic() < deadline, \
                "the head did not start"
            time.sleep(1)
        for _ in range(workers):
            nodes.append(_node(env, f"--address={address}", "--num-cpus=1"))
            while _alive(env, address) < len(nodes):
                assert nodes[-1].poll() is None and time.monotonic() < deadline, "no worker node"
                time.sleep(1)
        yield {"address": address, "env": env, "head": nodes[0],
               "worker": nodes[1] if workers else None}
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes():
    """A head of 2 CPUs and a worker node of 1 (`_cluster`)."""
    with _cluster(1) as cluster:
        yield cluster


def _titled(node: subprocess.Popen, title: str) -> bool:
    """Whether a process of `node` has the title `title` (`ray::ReadinessBoard`; Ray adds
    `.METHOD` while it runs a call)."""
    import psutil

    for child in psutil.Process(node.pid).children(recursive=True):
        try:
            words = child.cmdline()[0].split()
        except (psutil.Error, IndexError):
            continue
        if words and words[0].split(".")[0] == title:
            return True
    return False


def _replicas(node: subprocess.Popen) -> list[str]:
    """The Serve replica processes among a node's processes, by deployment: a replica's title
    is `ray::ServeReplica:APP:DEPLOYMENT`, and `….DEPLOYMENT.METHOD` while it runs a call (a
    readiness check, the metrics board's)."""
    import psutil

    names = []
    for child in psutil.Process(node.pid).children(recursive=True):
        try:
            title = child.cmdline()[0]
        except (psutil.Error, IndexError):
            continue
        if title.startswith("ray::ServeReplica:"):
            deployment = title.removeprefix("ray::ServeReplica:branchsearch:").split()[0]
            names.append(deployment.split(".")[0])
    return sorted(names)


def test_serve_on_two_nodes_keeps_answering_when_the_worker_node_dies(two_nodes, tmp_path):
    """The one ingress replica and the searcher were placed by Serve on any node. With the
    ingress on the worker, killing that node answered every request in flight through the
    head's proxy with a plain-text 500 `Internal Server Error` (10 of them under 16 callers on
    the netns cluster of `bench/cluster_nodes.py`), and cut its proxy's SSE streams; with its
    network down, every request, /readyz too, hung for as long as the outage (50 s). Now each
    node a proxy runs on has an ingress replica (the proxy routes to its own), and the
    searcher runs on the head: the head's proxy answers every request through the loss of the
    worker, as JSON, and a SIGTERM then stops the service, leaving no replica behind."""
    home = tmp_path / "home"
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "bm"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings, dense=False)
    key = KeyStore(home / "keys.json").add("alpha", ("alpha",))
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                             "--address", two_nodes["address"], "--host", "127.0.0.1",
                             "--port", str(port), "--home", str(home), "--index", "bm",
                             "--keys", str(home / "keys.json")], env=two_nodes["env"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/readyz", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert _replicas(two_nodes["head"]) == ["Ingress", "Searcher"]
        assert _replicas(two_nodes["worker"]) == ["Ingress"]
        # the readiness board beside the searcher: on the worker (Ray placed it there in 5 of
        # 6 runs of bench/service_outage.py when asked softly), its loss made /readyz 503
        # through the head's proxy while the head searched
        assert _titled(two_nodes["head"], "ray::ReadinessBoard")
        assert not _titled(two_nodes["worker"], "ray::ReadinessBoard")

        answers, cut, stop = [], [], threading.Event()

        def caller(i: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                while not stop.is_set():
                    try:
                        r = client.post("/v1/search", headers={"Authorization": f"Bearer {key}"},
                                        json={"question": f"Alpha harbor budget {i}",
                                              "branches": 2, "deadline_s": 10})
                    except httpx.TransportError as exc:  # through the worker's own proxy
                        cut.append(repr(exc))
                        continue
                    answers.append((r.status_code, r.headers.get("content-type", ""), r.text))

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
        for t in callers:
            t.start()
        time.sleep(4)
        os.killpg(two_nodes["worker"].pid, signal.SIGKILL)  # the worker node dies
        time.sleep(20)
        stop.set()
        for t in callers:
            t.join(90)
        assert answers and not any(t.is_alive() for t in callers)
        for status, ctype, text in answers:
            assert status == 200 or (status in (429, 503, 504)
                                     and ctype.startswith("application/json")), (status, text)
        assert sum(status == 200 for status, _, _ in answers) > len(answers) // 2, answers
        r = httpx.post(url + "/v1/search", headers={"Authorization": f"Bearer {key}"},
                       json={"question": "Alpha harbor budget"}, timeout=60)
        assert r.status_code == 200, r.text

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        deadline = time.monotonic() + 30
        while _replicas(two_nodes["head"]) and time.monotonic() < deadline:
            time.sleep(1)
        assert _replicas(two_nodes["head"]) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def one_node():
    """A head of 2 CPUs alone (`_cluster`)."""
    with _cluster(0) as cluster:
        yield cluster


ON_THE_CLUSTER = """
import logging, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
from ray import serve
what = sys.argv[2]
if what == "other":  # someone else's application, Serve's proxies on port argv[3]
    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self, request):
            return "hello"
    serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[3])})
    serve.run(Hello.bind(), name="other", route_prefix="/other")
elif what == "shutdown":
    serve.shutdown()
elif what == "deploying":  # wait until the application `branchsearch` is being deployed
    end = time.monotonic() + 240
    while "branchsearch" not in serve.status().applications and time.monotonic() < end:
        time.sleep(0.2)
else:  # what is on the cluster: applications, then Serve's actors
    print(sorted(serve.status().applications))
    print(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)))
"""


def test_serve_joining_a_cluster_leaves_it_as_it_found_it(one_node, tmp_path):
    """`serve --address` on one cluster. Serve already running there (someone else's app):
    a --port other than its proxies' served on theirs while the line named ours (`serving on
    http://127.0.0.1:P2` answered nothing; Serve warned 'The new HTTP config is ignored'), and
    its SIGTERM shut all of Serve down, the other application too. Now the other port is one
    line naming theirs, exit 2; the same port joins, and its SIGTERM takes only its own
    application away. A SIGTERM before it served (Serve not running) exited -15 with Ray's
    stack dump and left the application running on the cluster; now exit 0 and nothing left."""
    env = one_node["env"]
    home = tmp_path / "home"
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "bm"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings, dense=False)

    def cluster(*args) -> list[str]:
        done = subprocess.run([sys.executable, "-c", ON_THE_CLUSTER, one_node["address"],
                               *map(str, args)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()

    def serve(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                                 "--address", one_node["address"], "--host", "127.0.0.1",
                                 "--port", str(port), "--home", str(home), "--index", "bm"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def stopped(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
        try:
            err = proc.communicate(timeout=timeout)[1]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            err = proc.communicate()[1]
        return proc.returncode, err

    theirs, ours = free_port(), free_port()
    cluster("other", theirs)
    try:
        code, err = stopped(serve(ours))
        assert (code, err.strip()) == (2, (
            f"error: Ray Serve already runs on this cluster, its proxies on 127.0.0.1:"
            f"{theirs}, and keeps them: serve there (--host 127.0.0.1 --port {theirs}), or "
            "stop that Serve first (`serve shutdown`)")), (code, err[-2000:])
        proc = serve(theirs)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, stopped(proc, 5)
            try:
                if httpx.get(f"http://127.0.0.1:{theirs}/readyz", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert stopped(proc)[0] == 0
        assert httpx.get(f"http://127.0.0.1:{theirs}/other", timeout=30).text == "hello"
        apps, actors = cluster("status")
        assert apps == "['other']", (apps, actors)
    finally:
        cluster("shutdown")
    proc = serve(ours)
    cluster("deploying")
    proc.send_signal(signal.SIGTERM)
    code, err = stopped(proc)
    assert code == 0 and "serving on" not in err and "SIGTERM received" not in err, err[-2000:]
    assert "stopping before it served" in err, err[-2000:]
    assert cluster("status") == ["[]", "[]"]


def test_a_second_serve_on_the_cluster_leaves_the_first_serving(one_node, tmp_path):
    """Two `serve --address` on one cluster, on the same port (Serve has one proxy port), each
    with its own keys file and default index. The second replaced the first's application
    (both are named 'branchsearch'): the first's callers got 401 'unknown API key', and the
    second's stop deleted the application, so the first, still running and saying it served,
    answered every request a plain-text 404. Now the second is one line naming the first,
    exit 2, and the first goes on answering its own keys; once the first is gone (kill -9,
    its application left on the cluster), a new `serve` takes the application over."""
    env = one_node["env"]
    home = tmp_path / "home"
    home.mkdir()
    for index in ("bm", "другой"):
        ingest(write_corpus(home / "corpus.jsonl"),
               load_settings(overrides={"home": home, "index": index}, read_env=False,
                             read_file=False), dense=False)
    first_key = KeyStore(tmp_path / "first.json").add("первый", ["alpha"], [])
    second_key = KeyStore(tmp_path / "second.json").add("second", ["bravo"], [])
    port = free_port()

    def serve(index: str, keys: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                                 "--address", one_node["address"], "--host", "127.0.0.1",
                                 "--port", str(port), "--home", str(home), "--index", index,
                                 "--keys", str(tmp_path / keys)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def whoami(key: str) -> int:
        return _whoami(port, key)

    def ready(proc: subprocess.Popen, key: str) -> None:
        _wait_for_200(port, key, proc)

    first = serve("bm", "first.json")
    try:
        ready(first, first_key)
        second = serve("другой", "second.json")
        try:
            err = second.communicate(timeout=180)[1]
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            err = second.communicate()[1]
        assert second.returncode == 2, err[-2000:]
        assert err.strip().startswith("error: another `branchsearch serve` (pid "), err[-2000:]
        assert f"pid {first.pid} on " in err and "serves the application 'branchsearch'" in err
        assert [whoami(first_key) for _ in range(5)] == [200] * 5
        assert whoami(second_key) == 401
        os.killpg(first.pid, signal.SIGKILL)  # the application stays on the cluster
        first.wait(30)
        third = serve("другой", "second.json")
        try:
            ready(third, second_key)
            assert whoami(first_key) == 401
            third.send_signal(signal.SIGTERM)
            assert third.wait(120) == 0
        finally:
            if third.poll() is None:
                os.killpg(third.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        done = subprocess.run([sys.executable, "-c", ON_THE_CLUSTER, one_node["address"],
                               "shutdown"], env=env, capture_output=True, timeout=300)
        assert done.returncode == 0


def test_serve_whose_searcher_cannot_start_is_one_line_and_leaves_nothing(one_node, tmp_path):
    """`serve --address` while the default index's backend is down (an Elasticsearch not up
    yet; a Milvus server alike): the searcher replica's start failed until Serve gave up, and
    `serve` ended in a 100-line traceback ('Deploying application branchsearch failed: Failed
    to update the deployments ['Searcher']'), naming no cause, and left the failed application
    on the cluster, its ingress answering 503 'the searcher replica is restarting; retry'
    on the port, with Serve's proxy and controller. Now one line with the cause (no
    credentials), exit 2, and the cluster as it was."""
    from es_emulator import start_es_emulator

    env = one_node["env"]
    home = tmp_path / "home"
    home.mkdir()
    with start_es_emulator(tmp_path / "es") as es:
        url = es.url.replace("://", "://svc:hunter2@")
        ingest(write_corpus(home / "corpus.jsonl"),
               load_settings(overrides={"home": home, "index": "bm", "es_url": url},
                             read_env=False, read_file=False), dense=False)
    (home / "branchsearch.toml").write_text(f'es_url = "{url}"\n')
    KeyStore(home / "keys.json").add("k", ["alpha"], [])
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "branchsearch.orchestrator.cli", "serve",
                           "--address", one_node["address"], "--host", "127.0.0.1",
                           "--port", str(port), "--home", str(home), "--index", "bm",
                           "--config", str(home / "branchsearch.toml"),
                           "--keys", str(home / "keys.json")],
                          env=env, capture_output=True, text=True, timeout=400)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: the service did not start: ") and \
        "hunter2" not in lines[0], lines
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
    shown = subprocess.run([sys.executable, "-c", ON_THE_CLUSTER, one_node["address"], "status"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert shown.stdout.strip().splitlines() == ["[]", "[]"], shown.stdout + shown.stderr[-2000:]


def test_serve_says_its_searcher_cannot_start_at_the_first_failed_start(one_node, tmp_path):
    """`serve --address` while the default index's Elasticsearch takes connections and does
    not answer (frozen), `backend_timeout_s = 20`: each start of the searcher replica waits
    the 20 s, and `serve` waited for Serve to give up after its three tries and back-off (over
    60 s) before it said `error: the service did not start: …`. Now it says so once the
    first start has failed."""
    from es_emulator import start_es_emulator

    env = one_node["env"]
    home = tmp_path / "home"
    home.mkdir()
    with start_es_emulator(tmp_path / "es") as es:
        ingest(write_corpus(home / "corpus.jsonl"),
               load_settings(overrides={"home": home, "index": "bm", "es_url": es.url},
                             read_env=False, read_file=False), dense=False)
        (home / "branchsearch.toml").write_text(f'es_url = "{es.url}"\nbackend_timeout_s = 20\n')
        os.killpg(es.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--address",
                 one_node["address"], "--host", "127.0.0.1", "--port", str(free_port()),
                 "--home", str(home), "--index", "bm", "--config",
                 str(home / "branchsearch.toml")],
                env=env, capture_output=True, text=True, timeout=400)
            took = time.monotonic() - began
        finally:
            os.killpg(es.pid, signal.SIGCONT)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and errors and errors[0].startswith(
        "error: the service did not start: "), done.stderr[-3000:]
    print(f"serve said its searcher cannot start after {took:.1f} s")
    assert took < 55, took  # one start's 20 s and the cluster's own start; three are 60 s


def _whoami(port: int, key: str) -> int:
    """The status the service on `port` answers `key` at /v1/whoami."""
    return httpx.get(f"http://127.0.0.1:{port}/v1/whoami",
                     headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def _wait_for_200(port: int, key: str, proc: subprocess.Popen | None = None) -> None:
    """Until the service on `port` answers `key` 200, within 300 s; `proc`, the `serve` that
    should be answering, must stay alive meanwhile (its stderr is the failure's message)."""
    deadline = time.monotonic() + 300
    while True:
        if proc is not None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{key[:8]}… never answered 200"
        try:
            if _whoami(port, key) == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def _config_copy(tmp_path, port: int, home, index: str, keys: str):
    """A copy of deploy/serve_config.yaml with this test's paths, port, one replica each and
    the local executor; its path."""
    import yaml

    config = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                              "deploy", "serve_config.yaml")))
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"] |= {"home": str(home), "index": index, "keys": str(tmp_path / keys),
                    "executor": "local"}
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = 1
        deployment["ray_actor_options"] = {"num_cpus": 0}
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "serve_config.yaml"


def _two_deployers(one_node, tmp_path):
    """A home with indexes `bm` and `другой`; a Serve config (of `bm`, key file config.json)
    and a `branchsearch serve` command line (of `другой`, cli.json) for the same port; each
    side's key, `whoami(key)`: the status its key gets, and `answers(key)`: wait for a 200."""
    home = tmp_path / "home"
    home.mkdir()
    for index in ("bm", "другой"):
        ingest(write_corpus(home / "corpus.jsonl"),
               load_settings(overrides={"home": home, "index": index}, read_env=False,
                             read_file=False), dense=False)
    port = free_port()

    def whoami(key: str) -> int:
        return _whoami(port, key)

    def answers(key: str) -> None:  # once the application answers `key` (within 300 s)
        _wait_for_200(port, key)

    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli", "serve", "--address",
           one_node["address"], "--host", "127.0.0.1", "--port", str(port), "--home", str(home),
           "--index", "другой", "--keys", str(tmp_path / "cli.json")]
    return SimpleNamespace(
        env=one_node["env"], config=_config_copy(tmp_path, port, home, "bm", "config.json"),
        theirs=KeyStore(tmp_path / "config.json").add("config", ["alpha"], []),
        ours=KeyStore(tmp_path / "cli.json").add("cli", ["bravo"], []), cli=cli, whoami=whoami,
        answers=answers)


def test_serve_stopping_leaves_an_application_a_serve_config_put_over_it(one_node, tmp_path):
    """A `serve deploy CONFIG` (`serve run CONFIG` here) over a running `branchsearch serve`:
    Ray replaces its application without a word (the CLI's keys answer 401, the config's
    200), and the CLI's stop then shut Serve down, the config's application with it (every
    request refused). Now its stop leaves the config's application and Serve running, says
    so, and exits 0."""
    d = _two_deployers(one_node, tmp_path)
    env, config, theirs, ours, whoami = d.env, d.config, d.theirs, d.ours, d.whoami
    answers = d.answers
    proc = subprocess.Popen(d.cli, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        said = []
        while not any(line.startswith("serving on") for line in said):
            said.append(proc.stderr.readline())
            assert said[-1], "".join(said)[-3000:]  # it ended
        answers(ours)
        done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "serve"), "run",
                               "--address", one_node["address"], "--non-blocking",
                               str(config)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        answers(theirs)
        assert whoami(ours) == 401  # Ray's doing: the config replaced the CLI's application
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 0, err[-3000:]
        assert "deployed from a Serve config" in err, err[-3000:]
        assert [whoami(theirs) for _ in range(3)] == [200] * 3
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        done = subprocess.run([sys.executable, "-c", ON_THE_CLUSTER, one_node["address"],
                               "shutdown"], env=env, capture_output=True, timeout=300)
        assert done.returncode == 0


def test_serve_refuses_an_application_deployed_from_a_serve_config(one_node, tmp_path):
    """An operator deployed the service as Ray Serve users do (`serve run CONFIG` here, as
    `serve deploy CONFIG` does through the dashboard: both apply the config declaratively),
    from a copy of deploy/serve_config.yaml, with its keys and default index; then someone ran
    `branchsearch serve --address` on that cluster. No `branchsearch serve` owned that
    application, so `serve` replaced it under its callers (their keys answered 401) and its
    stop deleted it. Now `serve` is one line saying how to take the config's application off,
    exit 2, and the config's application goes on answering its own keys."""
    d = _two_deployers(one_node, tmp_path)
    env, config, theirs, ours, whoami = d.env, d.config, d.theirs, d.ours, d.whoami

    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    try:
        done = subprocess.run([serve_cli, "run", "--address", one_node["address"],
                               "--non-blocking", str(config)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        d.answers(theirs)  # the config's application started
        proc = subprocess.Popen(d.cli, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            err = proc.communicate(timeout=180)[1]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            err = proc.communicate()[1]
        assert (proc.returncode, err.strip()) == (2, (
            "error: another deployment serves the application 'branchsearch' on this cluster "
            "(deployed from a Serve config, not by `branchsearch serve`): `branchsearch serve` "
            "would replace it under its callers; take it off with `serve delete branchsearch` "
            "first, or change that config")), (proc.returncode, err[-3000:])
        assert [whoami(theirs) for _ in range(5)] == [200] * 5
        assert whoami(ours) == 401
    finally:
        done = subprocess.run([sys.executable, "-c", ON_THE_CLUSTER, one_node["address"],
                               "shutdown"], env=env, capture_output=True, timeout=300)
        assert done.returncode == 0


STRANDED_START = """
import json, os, sys, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.driver import Driver
address, home, retries = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = load_settings(overrides={"home": home, "index": "bm", "ray_address": address,
                                    "branches": 1, "search_mode": "bm25",
                                    "branch_retries": retries, "actor_start_timeout_s": 60},
                         read_env=False, read_file=False)
ray.init(address=address, log_to_driver=False)
head = next(n["NodeID"] for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" in n["Resources"])
class Hold:
    def ping(self):
        return 0
hold = ray.remote(Hold).options(num_cpus=2, scheduling_strategy=NodeAffinitySchedulingStrategy(
    head, soft=False)).remote()
ray.get(hold.ping.remote(), timeout=120)
"""  # a driver on a two-node cluster whose head has no CPU free (`Hold` takes it)

STRANDED = STRANDED_START + """
deadlines = [float(d) for d in sys.argv[4].split(",")]
driver = Driver(settings, mode="ray")  # on the worker's CPU: the head has none free
first = driver.search("Alpha harbor budget", deadline_s=60)
print(json.dumps({"first": first.status}), flush=True)
sys.stdin.readline()  # the worker node is gone
for deadline in deadlines:  # one question after another
    began = time.monotonic()
    try:
        late = {"status": driver.search("Alpha harbor budget", deadline_s=deadline).status}
    except BranchsearchError as exc:
        late = {"error": type(exc).__name__, "line": str(exc)}
    print(json.dumps({"took": time.monotonic() - began, **late}), flush=True)
os._exit(0)  # (closing waits on the stranded retriever)
"""


def _stranded(tmp_path, retries: int, deadlines: tuple[float, ...] = (3,)) -> list[dict]:
    """`STRANDED` on a two-node cluster (its retriever with `retries` restarts): what its
    questions after the worker node's death (one after another, with these `deadlines`)
    answered, and how long each took."""
    return _after_the_worker_dies(tmp_path, STRANDED, [str(retries),
                                                       ",".join(map(str, deadlines))],
                                  len(deadlines))


def _after_the_worker_dies(tmp_path, script: str, args: list[str], answers: int) -> list[dict]:
    """`script` (a `STRANDED_START` one) on a two-node cluster over a BM25 index: its first
    line once its driver answered, then the worker node killed, then its next `answers`
    JSON lines."""
    import json

    home = tmp_path / "home"
    home.mkdir()
    settings = load_settings(overrides={"home": home, "index": "bm"}, read_env=False,
                             read_file=False)
    ingest(write_corpus(home / "corpus.jsonl"), settings, dense=False)
    with _cluster(1) as cluster:
        proc = subprocess.Popen([sys.executable, "-c", script, cluster["address"], str(home),
                                 *args], env=cluster["env"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(proc.stdout.readline()) == {"first": "ok"}
            os.killpg(cluster["worker"].pid, signal.SIGKILL)  # the worker node dies
            deadline = time.monotonic() + 120
            while _alive(cluster["env"], cluster["address"]) > 1:
                assert time.monotonic() < deadline, "the worker node is still counted alive"
                time.sleep(1)
            proc.stdin.write("gone\n")
            proc.stdin.flush()
            return [json.loads(proc.stdout.readline()) for _ in range(answers)]
        finally:
            proc.kill()
            proc.wait(30)


def test_a_question_whose_retriever_cannot_be_restarted_ends_by_its_deadline(tmp_path):
    """A driver on a two-node cluster whose head has no CPU free: its retriever and branch
    actors run on the worker node, which dies. Ray restarts the retriever, and nothing can
    place it. A question with a 3 s deadline met the dead retriever and waited a minute for
    its answer (the executor's `revive`), after it, one question at a time: a service's search
    thread outlived its 504 by that much. Now the wait ends by the question's deadline."""
    [late] = _stranded(tmp_path, retries=1)
    assert late.get("status") in ("failed", "partial"), late
    assert late["took"] < 3 + 5, late  # (before: 60 s and more)


def test_a_question_whose_retriever_died_for_good_waits_for_its_fresh_start_until_its_deadline(
        tmp_path):
    """As above, with no restarts left (`branch_retries` 0): the retriever is dead for good
    and the question that meets it starts a fresh one, which nothing can place either. The
    3 s-deadline question waited for that start's whole `actor_start_timeout_s` (60 s here,
    300 s by default) and then failed; now it waits until its deadline and says the
    retriever is starting again: BackendUnavailable, a 503 to retry in the service. The
    question after it (a 30 s deadline) waited on that fresh replica, which Ray holds
    unplaced, until its deadline, and ended with every branch timed out (a 504); now it is
    told at once."""
    late, after = _stranded(tmp_path, retries=0, deadlines=(3, 30))
    assert late["took"] < 3 + 5, late  # (before: 60 s, the start's timeout)
    assert late.get("error") == "BackendUnavailable", late
    assert "started again, not started by the question's deadline" in late["line"], late
    assert after["took"] < 5, after  # (before: 30 s, its deadline)
    assert after.get("error") == "BackendUnavailable", after
    assert "not placed on a node yet" in after["line"], after


STRANDED_WRITE = STRANDED_START + """
import asyncio, sqlite3
from branchsearch.orchestrator.service.admission import Limits
from branchsearch.orchestrator.service.auth import ApiKey
from branchsearch.orchestrator.service.errors import api_error
from branchsearch.orchestrator.service.searcher import Searcher
searcher = Searcher(settings, executor="ray", limits=Limits(default_deadline_s=8),
                    driver_factory=lambda s, executor: Driver(s, mode="ray"))
driver = searcher.drivers.open("bm", wait=120)  # on the worker's CPU: the head has none free
print(json.dumps({"first": driver.search("Alpha harbor budget", deadline_s=60).status}),
      flush=True)
sys.stdin.readline()  # the worker node is gone
try:  # meets the dead retriever and starts a fresh one, which nothing can place
    driver.search("Alpha harbor budget", deadline_s=3)
except BranchsearchError:
    pass
def timed(fn):
    began = time.monotonic()
    try:
        fn()
        out = {"ok": True}
    except Exception as exc:
        error = api_error(exc)
        out = {"status": error.status, "code": error.error, "headers": error.headers}
    return {"took": time.monotonic() - began, **out}
admin = ApiKey("admin", ("*",), admin=True)
body = json.dumps([{"id": "late-doc", "text": "Written while the retriever had no node."}])
version = lambda: json.loads((settings.index_dir / "manifest.json").read_text())["version"]
began = version()
print(json.dumps(timed(lambda: asyncio.run(searcher.upsert("bm", body.encode(), admin)))
                 | {"version_kept": version() == began}), flush=True)
print(json.dumps(timed(lambda: searcher._probe("bm", driver))), flush=True)
ray.kill(hold)  # room again: the fresh retriever is placed and starts
ray.get(driver.executor.retriever.ping.remote(), timeout=120)
time.sleep(2)
db = sqlite3.connect(f"file:{settings.index_dir / 'docs.sqlite'}?mode=ro", uri=True)
held = db.execute("select count(*) from chunks where doc_id = 'late-doc'").fetchone()[0]
print(json.dumps({"landed": held}), flush=True)
os._exit(0)
"""


def test_a_write_or_probe_through_a_retriever_that_cannot_be_placed_ends_by_its_deadline(
        tmp_path):
    """As above (`branch_retries` 0): a question met the retriever dead for good and started a
    fresh one, which nothing can place. A document write through the service then waited for
    that placement with no bound, holding the index's write lock: its caller got a 504 at
    the deadline and the write went on, to land whenever the cluster had room again; an
    index probe (readiness, a failed search's) waited 120 s. Now a write waits for the fresh
    start until its deadline and is a 503 `backend_unavailable` with Retry-After, sent to no
    store, so it never lands later; a probe answers the same within `PROBE_TIMEOUT_S`."""
    from branchsearch.orchestrator.service.searcher import PROBE_TIMEOUT_S

    write, probe, landed = _after_the_worker_dies(tmp_path, STRANDED_WRITE, ["0"], 3)
    assert write.get("status") == 503 and write["code"] == "backend_unavailable", write
    assert write["headers"].get("Retry-After"), write
    assert write["took"] < 8 + 3, write  # its deadline (before: a 504 at 8 + 2 s, going on)
    assert write["version_kept"], write  # nothing sent: a batch's resume asks nothing again
    assert probe.get("status") == 503 and probe["code"] == "backend_unavailable", probe
    assert probe["took"] < PROBE_TIMEOUT_S + 3, probe  # (before: 120 s)
    assert landed == {"landed": 0}, landed  # (before: the write landed once placed)
