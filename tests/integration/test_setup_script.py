"""scripts/setup.sh on a fresh machine: the README promises the CPU build of torch (no CUDA
download). PyPI's Linux wheel of torch pulls ~3 GB of CUDA libraries, so the script takes the CPU
build from pip's own sources when they hold it (a wheel folder, a mirror), else from PyTorch's
CPU index. Run against a stand-in `.venv/bin/python` that logs each pip call: installing torch
for real takes minutes and gigabytes, and PyTorch's index is not reachable from here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def run_setup(tmp_path: Path, *, sources_have_cpu_wheel: bool) -> list[str]:
    """setup.sh in a copy of the repository whose .venv python answers pip's dry run for
    `torch==2.13.0+cpu` as pip's configured sources would; the pip calls it received."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "calls.log"
    refuse = "" if sources_have_cpu_wheel else (
        'case "$*" in *--dry-run*torch==2.13.0+cpu*) '
        'echo "ERROR: No matching distribution found for torch==2.13.0+cpu"; exit 1;; esac\n')
    (venv_bin / "python").write_text(f'#!/bin/bash\necho "$*" >> {log}\n{refuse}exit 0\n')
    (venv_bin / "python").chmod(0o755)
    done = subprocess.run(["bash", tmp_path / "scripts" / "setup.sh"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def torch_install(calls: list[str]) -> str:
    [call] = [c for c in calls if "torch==2.13.0" in c and "--dry-run" not in c]
    return call


@pytest.mark.parametrize("sources_have_cpu_wheel", [False, True])
def test_setup_installs_the_cpu_build_of_torch(tmp_path, sources_have_cpu_wheel):
    call = torch_install(run_setup(tmp_path, sources_have_cpu_wheel=sources_have_cpu_wheel))
    if sources_have_cpu_wheel:  # the CPU wheel where pip is configured to find it, no network
        assert "torch==2.13.0+cpu" in call and "download.pytorch.org" not in call, call
    else:  # a fresh machine: PyPI alone would give the CUDA build
        assert CPU_INDEX in call, call


def stand_in_python(path: Path, log: Path, version_ok: bool) -> Path:
    """A `python3` that passes (or fails) setup.sh's version check and, asked for `-m venv
    .venv`, makes a `.venv` whose python logs each call, as `run_setup`'s does."""
    venv_python = '#!/bin/bash\\necho "$*" >> ' + str(log) + '\\nexit 0\\n'
    path.write_text(
        "#!/bin/bash\n"
        f'case "$*" in -c*) exit {0 if version_ok else 1};; -V) echo "Python 3.9.2";; '
        f'"-m venv .venv") mkdir -p .venv/bin && printf \'{venv_python}\' > .venv/bin/python '
        "&& chmod +x .venv/bin/python;; esac\n")
    path.chmod(0o755)
    return path


def setup_with(tmp_path: Path, python: Path) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    return subprocess.run(["bash", tmp_path / "scripts" / "setup.sh"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": str(python)})


def test_a_venv_left_without_pip_is_made_again(tmp_path):
    """`python3 -m venv` on Debian without python3-venv leaves a .venv with a python and no
    pip; a second run of setup.sh used it and failed with 'No module named pip'."""
    log = tmp_path / "calls.log"
    broken = tmp_path / ".venv" / "bin" / "python"
    broken.parent.mkdir(parents=True)
    broken.write_text('#!/bin/bash\necho "/usr/bin/python: No module named pip" >&2; exit 1\n')
    broken.chmod(0o755)
    done = setup_with(tmp_path, stand_in_python(tmp_path / "python3", log, version_ok=True))
    assert done.returncode == 0, done.stderr
    assert "making it again" in done.stderr
    assert any("pip install" in call for call in log.read_text().splitlines())


def test_a_python_older_than_3_11_is_one_line_and_makes_no_venv(tmp_path):
    log = tmp_path / "calls.log"
    done = setup_with(tmp_path, stand_in_python(tmp_path / "python3", log, version_ok=False))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"setup: failed: branchsearch needs Python 3.11 or newer; '{tmp_path / 'python3'}' is "
        "Python 3.9.2 (run PYTHON=python3.11 bash scripts/setup.sh)"]
    assert not (tmp_path / ".venv").exists()
