"""A live service on loopback for the service tests: a small corpus with ACL'd documents, keys,
and a uvicorn server in a thread (port 0). Real stores, real HTTP; nothing mocked."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Group B's documents carry words no other document has; the questions of the leak test ask for
# them. LEAK_MARKER is in every B document and in no question, so finding it in a response means
# B's text came back (a question echoed back is not a leak).
SECRET_WORDS = ("quokkavault", "zephyrledger", "obsidianpact")
LEAK_MARKER = "marzipanfleet"
CORPUS = [
    {"_id": "pub-harbor", "title": "Harbor Festival",
     "text": "The Harbor Festival takes place every June in Portsmouth. Boats, music and a "
             "lantern parade along the quay draw visitors from the whole region."},
    {"_id": "pub-lighthouse", "title": "Old Lighthouse",
     "text": "The Old Lighthouse on the north cape was built in 1821 and guided ships into "
             "Portsmouth harbor until 1960."},
    {"_id": "a-roadmap", "title": "Alpha Roadmap", "acl": ["alpha"],
     "text": "The Alpha team roadmap plans the harbor sensor network for next spring; the "
             "lighthouse relay is its first milestone."},
    {"_id": "a-budget", "title": "Alpha Budget", "acl": ["alpha"],
     "text": "The Alpha budget funds twelve harbor sensors and one engineer for the lighthouse."},
    {"_id": "b-vault", "title": "Bravo Quokkavault", "acl": ["bravo"],
     "text": "Quokkavault is Bravo's secret harbor project: the zephyrledger records every boat "
             "at the lighthouse under the obsidianpact of the marzipanfleet."},
    {"_id": "b-ledger", "title": "Zephyrledger Plan", "acl": ["bravo"],
     "text": "The zephyrledger plan of the Bravo group moves the quokkavault archive to the "
             "harbor festival grounds; obsidianpact members of the marzipanfleet only."},
]

# ids that read as another id: a character output does not show (Cc, Cf) or a full-width
# look-alike of an ASCII letter or digit; the error names the character
LOOKALIKE_IDS = [("memo\u200b1", "format character U+200B (ZERO WIDTH SPACE)"),
                 ("\ufeffmemo2", "format character U+FEFF (ZERO WIDTH NO-BREAK SPACE)"),
                 ("me\u2060mo3", "format character U+2060 (WORD JOINER)"),
                 ("me\u00admo4", "format character U+00AD (SOFT HYPHEN)"),
                 ("memo\u200e5", "format character U+200E (LEFT-TO-RIGHT MARK)"),
                 ("a\u200db", "format character U+200D (ZERO WIDTH JOINER)"),
                 ("a\ufe0f\u200db", "format character U+200D (ZERO WIDTH JOINER)"),
                 ("memo\U000e00677", "format character U+E0067 (TAG LATIN SMALL LETTER G)"),
                 ("\U0001f3f4\U000e0067\U000e007f\U000e0067\U000e007f8",
                  "format character U+E0067 (TAG LATIN SMALL LETTER G)"),
                 ("\uff2d\uff25\uff2d\uff2f6", "full-width 'M' (U+FF2D), which reads as the "
                                               "ASCII 'M'"),
                 ("memo-\uff17", "full-width '7' (U+FF17), which reads as the ASCII '7'")]
# ids that stay: CJK (with full-width punctuation), RTL, emoji (a ZWJ sequence, one whose first
# emoji has its presentation selector: the rainbow flag, the heart on fire; a flag of tag
# characters: England's), Persian with a zero-width non-joiner, Devanagari with a joiner, NFD,
# Japanese with full-width digits and letters beside kanji and kana
KEPT_IDS = ["会议纪要（终稿）", "مذكرة-١", "launch-👩\u200d💻",
            "pride-\U0001f3f3\ufe0f\u200d\U0001f308", "\u2764\ufe0f\u200d\U0001f525-memo",
            "team-\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
            "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\u0915\u094d\u200d\u0937",
            "cafe\u0301-memo", "第\uff11章", "\uff2e\uff34\uff34ドコモ"]


def write_corpus(path: Path, rows=CORPUS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    server: object
    thread: threading.Thread
    state: object

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.server.config.timeout_graceful_shutdown + 15)


def start_uvicorn(app, state, grace_s: float = 30) -> LiveServer:
    """The app on a free loopback port, in a thread, as `serve --standalone` runs it
    (`deploy.standalone_server`: `stop` drains requests in flight for `grace_s`)."""
    from branchsearch.orchestrator.service.deploy import standalone_server

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = standalone_server(app, state, grace_s, lifespan="off")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return LiveServer(f"http://127.0.0.1:{port}", server, thread, state)


def mounted_at(app, prefix: str, strict: bool = True):
    """`app` under a route `prefix` ("/x"), as Ray Serve's proxy runs an application with
    `route_prefix="/x"` (and as Starlette's `Mount` does): a request for `prefix` or a path
    below it reaches `app` with its whole path and ASGI `root_path` = prefix. Any other path
    is a plain-text 404 from the proxy (`strict`), or reaches `app` unprefixed, at the root
    (`strict=False`: one app and server at both, as if deployed twice)."""
    assert prefix.startswith("/") and not prefix.endswith("/")

    async def proxy(scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            if path == prefix or path.startswith(prefix + "/"):
                scope = dict(scope, root_path=scope.get("root_path", "") + prefix)
            elif strict:
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"not under " +
                            prefix.encode()})
                return
        await app(scope, receive, send)

    return proxy
