"""Hold a Milvus 2.3.5 standalone server (the PyPI `milvus` package, started through
tests/milvus_server.start_milvus_server) with extra milvus.yaml values.

    python bench/milvus_segments/server.py DATA_DIR INFO_JSON [--set dotted.key=value ...]

Writes INFO_JSON = {"uri", "pid" (the `milvus` binary), "holder_pid", "config", "set"} once the
server answers /healthz, then sleeps until SIGTERM/SIGINT, when start_milvus_server's exit
stops the binary by its PID (SIGTERM, then SIGKILL after 15 s).

The values are written into DATA_DIR/configs/milvus.yaml by editing lines of the package's
template (the same thing the package's own `extra_configs` does for keys the template has);
a key the template lacks is inserted under its parent block. After writing, the file is
re-read with PyYAML and every key checked, so a value that did not land fails the start.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import milvus  # noqa: E402
import yaml  # noqa: E402


def parse_value(text: str):
    return yaml.safe_load(text)  # 8192 -> int, 0.9 -> float, true -> bool, else str


def set_key(lines: list[str], dotted: str, value) -> list[str]:
    """Set `dotted` (a.b.c) to `value` in the YAML text `lines` (2-space indentation), keeping
    comments; insert the leaf under its parent block when it is missing."""
    parts = dotted.split(".")
    text_value = json.dumps(value) if isinstance(value, str) else (
        ("true" if value else "false") if isinstance(value, bool) else str(value))
    start, end, depth = 0, len(lines), 0
    for depth, part in enumerate(parts):
        pat = re.compile(r"^" + " " * (2 * depth) + re.escape(part) + r":(\s|$)")
        found = None
        for i in range(start, end):
            if pat.match(lines[i]):
                found = i
                break
        if found is None:
            if depth < len(parts) - 1:
                # create the missing intermediate blocks and the leaf right after the parent
                new = [" " * (2 * d) + p + ":" for d, p in enumerate(parts[depth:-1], depth)]
                new.append(" " * (2 * (len(parts) - 1)) + parts[-1] + ": " + text_value)
            else:
                new = [" " * (2 * depth) + part + ": " + text_value]
            return lines[:start] + new + lines[start:]
        if depth == len(parts) - 1:
            m = re.match(r"^(\s*[^:#]+):([^#]*)(#.*)?$", lines[found])
            comment = f" {m.group(3)}" if m and m.group(3) else ""
            lines[found] = " " * (2 * depth) + part + ": " + text_value + comment
            return lines
        # the block of this key: following lines indented deeper (or blank / comments)
        start = found + 1
        block_end = start
        for i in range(start, end):
            s = lines[i]
            if not s.strip() or s.lstrip().startswith("#"):
                continue
            if len(s) - len(s.lstrip(" ")) <= 2 * depth:
                break
            block_end = i + 1
        end = block_end
    return lines


def main() -> None:
    data_dir, info_path = Path(sys.argv[1]), Path(sys.argv[2])
    sets: dict[str, object] = {}
    args = sys.argv[3:]
    while args:
        a = args.pop(0)
        if a == "--set":
            a = args.pop(0)
        key, _, val = a.partition("=")
        sets[key] = parse_value(val)

    orig_write = milvus.MilvusServerConfig.write_config

    def write_config(self):
        orig_write(self)
        path = Path(self.base_data_dir) / "configs" / "milvus.yaml"
        lines = path.read_text().splitlines()
        for k, v in sets.items():
            lines = set_key(lines, k, v)
        path.write_text("\n".join(lines) + "\n")
        loaded = yaml.safe_load(path.read_text())
        for k, v in sets.items():
            node = loaded
            for p in k.split("."):
                node = node[p]
            if node != v:
                raise RuntimeError(f"{k}: milvus.yaml has {node!r}, wanted {v!r}")

    # start_milvus_server wraps the instance's write_config (its own etcd ports) around this
    milvus.MilvusServerConfig.write_config = write_config
    from milvus_server import start_milvus_server

    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with start_milvus_server(data_dir) as h:
        info = {"uri": h.uri, "pid": h.pid, "holder_pid": __import__("os").getpid(),
                "config": str(data_dir / "configs" / "milvus.yaml"), "set": sets,
                "started_s": round(h.started_s, 1)}
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(info_path)
        print(f"milvus {h.uri} PID {h.pid} started in {h.started_s:.0f} s; set {sets}",
              flush=True)
        while not stop["now"]:
            time.sleep(0.5)
        print(f"stopping milvus PID {h.pid}", flush=True)
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
