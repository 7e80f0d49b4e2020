"""`branchsearch serve` and `branchsearch keys …`.

Only parsing and printing; the service is `orchestrator.service` (`deploy` runs it), keys are
`orchestrator.service.auth`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from branchsearch.infra.config.choices import EXECUTORS, one_of
from branchsearch.infra.errors import BranchsearchError
from branchsearch.orchestrator.cli.options import ConfigOpt, HomeOpt, JsonOpt

DEFAULT_KEYS = Path(".branchsearch") / "keys.json"
KeysOpt = typer.Option(None, "--keys", help="keys file (default: HOME/keys.json, or "
                                            "BRANCHSEARCH_KEYS)")
KeysHomeOpt = typer.Option(None, "--home", help="branchsearch home whose keys.json to use "
                                                "(default BRANCHSEARCH_HOME, else .branchsearch)")

keys_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="API keys for `branchsearch serve` (bound to ACL groups).")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.add_typer(keys_app, name="keys")


def _keys_path(path: Path | None, home: Path | None = None) -> Path:
    """--keys, else --home's keys.json, else BRANCHSEARCH_KEYS, else BRANCHSEARCH_HOME's
    keys.json, else .branchsearch/keys.json: a flag beats a variable."""
    import os

    if path is not None:
        return path
    if home is not None:
        return Path(home) / "keys.json"
    if os.environ.get("BRANCHSEARCH_KEYS"):
        return Path(os.environ["BRANCHSEARCH_KEYS"])
    if os.environ.get("BRANCHSEARCH_HOME"):
        return Path(os.environ["BRANCHSEARCH_HOME"]) / "keys.json"
    return DEFAULT_KEYS


@keys_app.command("add")
def keys_add(name: str, groups: str = typer.Option("", "--groups", help="ACL groups, g1,g2 "
                                                    "(none: public documents only)"),
             indexes: str = typer.Option("", "--indexes", help="allowed indexes a,b (default "
                                                               "all)"),
             admin: bool = typer.Option(False, "--admin", help="may write documents of its "
                                        "groups"),
             all_groups: bool = typer.Option(False, "--all-groups", help="with --admin: a global "
                                             "admin that sees and writes every document"),
             keys: Optional[Path] = KeysOpt, home: Optional[Path] = KeysHomeOpt):
    """Make a key; prints it once (only its hash is stored)."""
    import unicodedata

    from branchsearch.orchestrator.service.auth import KeyStore, parse_list

    store = KeyStore(_keys_path(keys, home))
    key = store.add(name, parse_list(groups), parse_list(indexes), admin, all_groups)
    print(key)
    made = {k.name: k for k in store.list()}[unicodedata.normalize("NFC", name)]  # as stored
    shown = ("all (global admin)" if all_groups else ",".join(made.groups)
             or "none — public documents only")
    print(f"key {made.name!r} added to {store.path} (groups: {shown}; "
          f"indexes: {','.join(made.indexes) or 'all'}{'; admin' if admin else ''}). It is "
          "shown only now.", file=sys.stderr)
    if admin and not all_groups and not parse_list(groups):
        print("note: an admin key without groups writes no document (a scoped admin writes "
              "only documents whose groups are all its own): give --groups, or --all-groups",
              file=sys.stderr)
    missing = sorted(set(made.indexes) - set(_home_indexes(store.path.parent)))  # (NFC)
    if missing:  # a typo, or an index made later: the key is kept either way
        print(f"note: no index {', '.join(map(repr, missing))} in {store.path.parent} now; "
              "the key may use it once it exists", file=sys.stderr)


def _home_indexes(home: Path) -> list[str]:
    """The indexes of the home a keys file sits in (owned and declared); [] when it cannot
    be read (the key is made all the same)."""
    try:
        from branchsearch.infra.config.settings import load_settings
        from branchsearch.infra.index.catalog import index_names

        config = home / "branchsearch.toml"
        return index_names(load_settings(config if config.is_file() else None,
                                         {"home": home}))
    except Exception:  # noqa: BLE001 — a note only
        return []


@keys_app.command("list")
def keys_list(keys: Optional[Path] = KeysOpt, home: Optional[Path] = KeysHomeOpt,
              as_json: bool = JsonOpt):
    """Keys in the file (names and grants; never the keys)."""
    import json

    from branchsearch.orchestrator.cli.render import pad
    from branchsearch.orchestrator.service.auth import KeyStore

    rows = [k.public() for k in KeyStore(_keys_path(keys, home)).list()]
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{pad(r['name'], 20)} {'revoked' if r['revoked'] else 'active':<8} "
              f"{'admin' if r['admin'] else '':<6} groups={','.join(r['groups']) or '-'} "
              f"indexes={','.join(r['indexes']) or '*'} created={r['created']}")


@keys_app.command("revoke")
def keys_revoke(name: str, keys: Optional[Path] = KeysOpt,
                home: Optional[Path] = KeysHomeOpt):
    """Revoke a key (a running server refuses it from the next request)."""
    from branchsearch.orchestrator.service.auth import KeyStore

    KeyStore(_keys_path(keys, home)).revoke(name)
    print(f"revoked {name!r}", file=sys.stderr)


def serve(ctx: typer.Context,
          index: Optional[str] = typer.Option(None, "--index", help="the default index: "
                                              "the one a request that names none searches "
                                              "(default: the home's only index; a home of "
                                              "several has none unless named). Every index "
                                              "of the home is served either way"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to listen on "
                                   "(0.0.0.0: every interface; needs --keys)"),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to listen on"),
          keys: Optional[Path] = typer.Option(None, "--keys", help="keys file (default: "
                                              "HOME/keys.json when it exists); without one the "
                                              "server is loopback-only (development)"),
          replicas: Optional[int] = typer.Option(None, "--replicas", min=1, help="ingress "
                                                 "replicas (default: one on each node an HTTP "
                                                 "proxy runs on; Ray Serve only)"),
          address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address"),
          executor: str = typer.Option("ray", "--executor", help="ray | local (branches "
                                       "in the searcher process)"),
          max_queued: int = typer.Option(32, "--max-queued", min=1, help="searches waiting for "
                                         "the searcher before 503 (Serve queue limit; Ray "
                                         "Serve only: --standalone bounds searches with the "
                                         "setting max_in_flight)"),
          max_searches: int = typer.Option(16, "--max-searches", min=1, help="searches at "
                                           "once per searcher replica (Ray Serve only, as "
                                           "--max-queued)"),
          searcher_replicas: int = typer.Option(1, "--searcher-replicas", min=1, help="searcher "
                                                "replicas (Ray Serve only; more than 1 only "
                                                "when every index is on server backends: no "
                                                "Milvus Lite file)"),
          standalone: bool = typer.Option(False, "--standalone", help="uvicorn in this process, "
                                          "no Ray Serve (the ray executor still starts or "
                                          "joins a Ray cluster for the branches; --executor "
                                          "local runs them here too)"),
          home: Optional[Path] = HomeOpt, config: Optional[Path] = ConfigOpt):
    """Run the search service (Ray Serve + FastAPI) over every index of the data home: JSON
    and streaming search, API keys, document upsert/delete, /metrics, a web page at /."""
    from branchsearch.orchestrator.cli.options import say, settings_of_home
    from branchsearch.orchestrator.service import deploy as service
    from branchsearch.orchestrator.service.searcher import check_default

    if executor not in EXECUTORS:
        raise BranchsearchError(f"unknown executor {executor!r}: {one_of(EXECUTORS)}")
    if standalone:
        check_standalone(ctx)
    found = _keys_path(None, home)
    default_keys = keys is None and found.exists()  # where `keys add` put them
    if default_keys:
        keys = found
    service.check_host(host, keys)
    if keys is not None and not keys.exists():
        raise BranchsearchError(f"keys file {keys} not found (make one with `branchsearch keys "
                                f"add NAME --groups G --keys {keys}`)")
    settings, several, picked = settings_of_home(home, index, config, ray_address=address)
    if not several:
        check_default(settings)  # one line before anything starts, not a replica's traceback
    if not standalone:
        service.check_searcher_replicas(settings, searcher_replicas)
    # a taken port is said before any index is opened; with Ray Serve on a local cluster (its
    # proxy binds here) also before the cluster starts, and on a cluster joined before Serve
    # starts there: not as the traceback of a proxy that failed to bind
    sock = service.listen(host, port) if standalone else None
    if not (standalone or settings.ray_address or os.environ.get("RAY_ADDRESS")):
        service.listen(host, port).close()
    elif not standalone:
        service.check_head_port(settings, host, port)
    # said once it serves: a mistake found before is its one line
    say(picked)
    if several:  # every one served; a request names its own
        print(f"no default index: this data home ({settings.home}) has "
              f"{', '.join(map(repr, several))}, and a search names one as `index` (without, "
              "a 422); --index NAME makes one the default", file=sys.stderr)
    if default_keys:
        print(f"keys file {keys}", file=sys.stderr)
    if standalone:
        if not keys:
            print(service.dev_mode_banner(host, sock.getsockname()[1]), file=sys.stderr)
        service.run_standalone(settings, executor=executor, keys=keys, sock=sock,
                               default_index=not several)
        return
    if not keys:
        print(service.dev_mode_banner(host, port), file=sys.stderr)
    service.run_serve(settings, service.ServeOptions(
        home=str(Path(settings.home).resolve()), index="" if several else settings.index,
        config=str(config.resolve()) if config else None,
        keys=str(keys.resolve()) if keys else None, executor=executor, replicas=replicas or 0,
        searcher_max_queued=max_queued, searcher_max_ongoing=max_searches,
        searcher_replicas=searcher_replicas), host, port)


# `serve`'s options that size Ray Serve's deployments
SERVE_ONLY = ("replicas", "max_queued", "max_searches", "searcher_replicas")


def check_standalone(ctx: typer.Context) -> None:
    """`serve --standalone` has no Ray Serve deployments, so no replicas and no searcher
    queue: an option that sizes them (`SERVE_ONLY`), given, would do nothing there, and is
    refused with the setting that bounds a standalone server's searches (`max_in_flight`,
    past which it answers 503 `overloaded`)."""
    given = [f"--{name.replace('_', '-')}" for name in SERVE_ONLY  # (typer has its own click)
             if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
    if given:
        raise BranchsearchError(
            f"{', '.join(given[:-1]) + ' and ' if given[:-1] else ''}{given[-1]} "
            f"{'sizes' if len(given) == 1 else 'size'} Ray Serve's "
            "deployments, which serve --standalone does not use: it runs each admitted search "
            "at once, up to the setting max_in_flight (then 503 overloaded; max_in_flight under "
            "[service] in the settings file, or BRANCHSEARCH_MAX_IN_FLIGHT); leave "
            f"{'it' if len(given) == 1 else 'them'} out, or serve without --standalone")
