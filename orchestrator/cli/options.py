"""What every command shares: the common options, the settings merge (file, environment,
flags), the caller's ACL groups, a writable-output check and the progress bar."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from branchsearch.infra.backends import MAX_K
from branchsearch.infra.choices import EXECUTORS, POLICIES
from branchsearch.infra.errors import BranchsearchError
from branchsearch.infra.settings import Settings, load_settings

HomeOpt = typer.Option(None, "--home", help="data home (default ./.branchsearch)")
IndexOpt = typer.Option(None, "--index", help="index name (default 'default')")
ConfigOpt = typer.Option(None, "--config", help="settings TOML file")


def choice(*allowed: str):
    def check(value):
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value
    return check


ExecutorOpt = typer.Option("ray", "--executor", callback=choice(*EXECUTORS),
                           help="ray (actors) | local (in-process); one branch runs in-process "
                                "unless a Ray address is set")
PolicyOpt = typer.Option(None, "--policy", callback=choice(*POLICIES),
                         help=" | ".join(POLICIES))
AclOpt = typer.Option(None, "--acl", help="a group the caller holds (repeat for several); "
                                          "without --acl: public documents only")
AclAdminOpt = typer.Option(False, "--acl-admin", help="see every document, restricted or not "
                                                      "(also: acl_admin = true in settings)")
KOpt = typer.Option(10, "--k", min=1, max=MAX_K, help=f"hits to return (1..{MAX_K})")
AddressOpt = typer.Option(None, "--address", help="Ray cluster address (default RAY_ADDRESS, "
                                                   "else a local cluster)")


def settings_from(home, index, config, **flags) -> Settings:
    return load_settings(config, {"home": home, "index": index, **flags})


def caller_acl(settings: Settings, groups: list[str] | None, admin: bool) -> list[str] | None:
    """The caller's `acl_groups`: None (public only), its groups, or ACL_ALL for an admin."""
    from branchsearch.infra.backends import caller_groups

    return caller_groups(groups, admin or settings.acl_admin)


def writable_file(path: Path, what: str) -> None:
    """Stop with one line when `path` cannot be written as a file (a folder, no permission)."""
    import os

    if path.is_dir():
        raise BranchsearchError(f"{what} {path} is a folder: give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    while not folder.exists() and folder != folder.parent:  # created on write
        folder = folder.parent
    if not folder.is_dir():
        raise BranchsearchError(f"{what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise BranchsearchError(f"{what} {path}: no permission to write there")


def progress_bar(total: int | None, unit: str, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=None)
