"""The `branchsearch` app: every command group registered from one list, and `main`, which turns
every user-caused error into one `error:` line. Commands only parse, merge settings, build and
run."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import typer

from branchsearch.infra.errors import BranchsearchError, redact
from branchsearch.infra.terminal import one_line
from branchsearch.orchestrator.cli import index, jobs, search, serve

COMMAND_GROUPS = (index, search, jobs, serve)  # each has register(app)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Parallel-branch evidence search over Milvus + BM25 (see README).")
for group in COMMAND_GROUPS:
    group.register(app)
for _command in app.registered_commands:  # the command list shows each first paragraph whole,
    _doc = inspect.getdoc(_command.callback) or ""  # not cut where the docstring's lines end
    _command.short_help = _command.short_help or " ".join(_doc.split("\n\n")[0].split())


def main() -> None:
    """Run the app; every user-caused error ends as one `error:` line and exit status 2."""
    quiet_already = _stdout_is_null()
    try:
        # not standalone, typer *returns* a command's `typer.Exit(code)` and Ctrl-C (130)
        code = app(prog_name="branchsearch", standalone_mode=False)
    except KeyboardInterrupt:
        code = 130
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        if exc.code == 1 and (_reader_went_away() or (_stdout_is_null() and not quiet_already)):
            sys.exit(141)  # `search | head`: as a tool SIGPIPE stops, not 1 ("failed")
        raise
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        message = user_error(exc)
        if message is None:
            raise
        if message:
            print(f"error: {redact(message)}", file=sys.stderr)  # no password, key or token
        else:  # no arguments: the help text is the answer
            exc.show()
        sys.exit(2)
    if code == 130:
        print("interrupted", file=sys.stderr)
    if isinstance(code, int) and code:
        sys.exit(code)


def _reader_went_away() -> bool:
    """Whether stdout's reader closed the pipe: click (typer's copy of it) then wraps stdout
    in its PacifyFlushWrapper and exits 1."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _stdout_is_null() -> bool:
    """Whether file descriptor 1 is /dev/null: rich (typer's help) answers a closed pipe by
    pointing it there and exiting 1 (`--help | head`)."""
    import os

    try:
        out, null = os.fstat(1), os.stat(os.devnull)
    except OSError:
        return False
    return (out.st_rdev, out.st_ino) == (null.st_rdev, null.st_ino)


def user_error(exc: BaseException) -> str | None:
    """The one line to show for a user-caused error ("" = show the exception's own text),
    or None for a bug (which keeps its traceback). A control character the message quotes (a
    corpus file's name, a document's words) is shown as its escape (`one_line`)."""
    cause = getattr(exc, "cause", None)  # a Ray task error: the original exception
    if isinstance(cause, BranchsearchError):
        return one_line(str(cause))
    if isinstance(exc, BranchsearchError):
        return one_line(str(exc))
    if isinstance(exc, typer.TyperException) or _is_click_error(exc):  # usage errors
        message = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        if not message:
            return ""
        misplaced = _option_before_its_command(exc, ctx)
        if misplaced:
            return misplaced
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        return one_line(message) + where
    cause = _user_cause(exc)
    if cause is not None:
        return one_line(str(cause))
    if isinstance(exc, OSError):
        return _path_error(exc)
    return None


def _option_before_its_command(exc: Exception, ctx) -> str | None:
    """`branchsearch --home X search …`: an option of the commands given before the command,
    where only --help is taken. Says where it goes; None for an option no command takes."""
    option = getattr(exc, "option_name", None)
    commands = getattr(getattr(ctx, "command", None), "commands", None)
    if not option or not commands:
        return None

    def takes(command) -> bool:  # a group (`keys`): one of its commands
        return (any(option in param.opts for param in command.params)
                or any(map(takes, getattr(command, "commands", {}).values())))

    takers = [name for name, command in commands.items() if takes(command)]
    if not takers:
        return None
    named = next((arg for arg in sys.argv[1:] if arg in commands), None)
    path = ctx.command_path
    if named in takers:
        return (f"{option} goes after the command: `{path} {named} … {option} …` "
                f"(see `{path} {named} --help`)")
    return f"{option} goes after a command that takes it: {', '.join(takers)}"


def _path_error(exc: OSError) -> str | None:
    """A file the user named where a folder must be (`--home FILE` for `keys`), or a full disk,
    when no command turned it into its own line. Other OS errors keep their traceback."""
    import errno

    name = exc.filename
    if exc.errno == errno.ENOTDIR and name is not None:
        path = Path(name)
        while path != path.parent and not path.exists():
            path = path.parent
        if path.exists() and not path.is_dir():
            return one_line(f"{name}: {path} is a file, not a folder")
        return one_line(f"{name}: a part of this path is not a folder")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        where = f" writing {name}" if name is not None else ""
        return one_line(f"the disk is full{where} ({exc.strerror}): free space and run the "
                         "command again")
    return None


def _is_click_error(exc: BaseException) -> bool:
    click = sys.modules.get("click")  # a plain click, if anything imported one
    return click is not None and isinstance(exc, click.ClickException)


def _user_cause(exc: BaseException) -> BaseException | None:
    """A BranchsearchError behind a wrapper (a Ray task that raised it, a chained error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BranchsearchError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None




if __name__ == "__main__":  # python -m branchsearch.orchestrator.cli.main
    main()
