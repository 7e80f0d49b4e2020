"""The README tells the truth about the tree: its architecture block names every package and
module that exists and nothing that does not, and every path it names is there. Plain file reads,
no subprocess."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TOP = ("orchestrator", "workers", "fusion", "infra")


def architecture_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Architecture\n", 1)[1]
    return section.split("```\n", 2)[1]


def named_in_block() -> dict[str, set[str]]:
    """Folder (relative to the root) -> the names listed for it: modules, and `sub/` for a
    folder. A line at column 0 or 2 that starts with `name/` opens a folder (two spaces: a
    sub-folder of the last top folder); deeper lines continue it. Items are separated by `·`;
    parenthesised words (on one line) describe them."""
    named: dict[str, set[str]] = {}
    top = current = None
    for line in architecture_block().splitlines():
        head = re.match(r"^( {0,2})([a-z_]+/)\s+(.*)$", line)
        if head and len(head.group(1)) in (0, 2) and not line.startswith("   "):
            indent, folder, rest = head.groups()
            if indent == "":
                top = current = folder.rstrip("/")
            else:
                assert top is not None, line
                current = f"{top}/{folder.rstrip('/')}"
                named.setdefault(top, set()).add(folder)
        else:
            rest = line.strip()
        assert current is not None, line
        assert rest.count("(") == rest.count(")"), f"keep a description on one line: {line!r}"
        rest = re.sub(r"\([^)]*\)", "", rest)  # descriptions
        rest = rest.split(" — ", 1)[0]
        for item in rest.split("·"):
            words = item.split()
            if words:
                named.setdefault(current, set()).add(words[0])
    return named


def on_disk(folder: str) -> set[str]:
    path = ROOT / folder
    modules = {p.stem for p in path.glob("*.py") if not p.stem.startswith("__")}
    folders = {p.name + "/" for p in path.iterdir()
               if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    return modules | folders


def test_the_block_names_what_exists():
    for folder, names in named_in_block().items():
        assert (ROOT / folder).is_dir(), f"README names {folder}/, which does not exist"
        missing = {n for n in names
                   if not (ROOT / folder / (n[:-1] if n.endswith("/") else f"{n}.py")).exists()}
        assert not missing, f"README names {sorted(missing)} in {folder}/; not in the tree"


def test_every_package_and_module_is_in_the_block():
    named = named_in_block()
    packages = {str(p.parent.relative_to(ROOT)) for top in TOP
                for p in (ROOT / top).rglob("__init__.py")}
    unnamed = packages - set(named)
    assert not unnamed, f"packages missing from the README's architecture block: {unnamed}"
    for folder in sorted(packages):
        left_out = on_disk(folder) - named[folder]
        assert not left_out, f"{folder}/ has {sorted(left_out)}, not in the README's block"


def test_every_path_the_readme_names_exists():
    text = README.read_text(encoding="utf-8")
    paths = set(re.findall(r"(?<![\w./-])((?:\w[\w.-]*/)+[\w.-]*\.(?:py|md|json|yaml|toml|png))\b",
                           text))
    paths |= set(re.findall(r"`((?:[\w.-]+/)+)`", text))  # `folder/` in code spans
    paths |= set(re.findall(r"\]\(((?!https?:)[^)#]+)", text))  # link targets
    # written by a command in the tour, or a place on the user's side
    made = ("out/", "../shared/", ".branchsearch/", "reports/loadtest/run")
    checked = [p for p in paths if not p.startswith(made)]
    assert len(checked) > 20, checked
    missing = sorted(p for p in checked if not (ROOT / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
