"""Faster CPU embedding: the local sentence-transformers model exported to ONNX Runtime or
OpenVINO (fp32, or int8), cached on disk, run without torch.

Why not `SentenceTransformer(..., backend="onnx")`: that path goes through Optimum, whose
releases pin transformers (optimum-onnx 0.1: transformers < 4.58; optimum-intel 2.2 fails to
import with the transformers 5 this project runs). Exporting here needs only torch (already
installed, for the export itself), onnxruntime, openvino and nncf, and never the network:

* `onnx`: the model's transformer + its pooling + L2 normalisation traced into one ONNX graph
  (torch.onnx TorchScript exporter, eager attention, the padding mask built outside the
  transformers mask helpers, which do not trace), run by ONNX Runtime.
* `onnx-int8`: that graph with dynamic int8 quantization (weights 8-bit per channel,
  activations quantized per batch, the FFN output projections left fp32; `onnxruntime.quantization.quantize_dynamic`, what
  sentence-transformers' `export_dynamic_quantized_onnx_model` does through Optimum).
* `openvino`: the ONNX graph read by OpenVINO.
* `openvino-int8`: OpenVINO post-training static int8 quantization (NNCF, transformer preset,
  what `export_static_quantized_openvino_model` does), calibrated on local text (the model
  card and a fixed set of passages; never a downloaded data set).

An export is written once per (model folder, backend, exporter version) under the export root
(`$BRANCHSEARCH_MODEL_CACHE`, else `~/.cache/branchsearch/models`: one per machine, shared by
every home and process), atomically (a temporary folder
renamed into place), so concurrent processes (Ray actors) never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-int8")
DEFAULT_BACKEND = "torch"  # settings `embed_backend`; chosen by measurement (reports/embedding.md)
# a text's vector does not depend on the other texts in its batch (dynamic int8 quantizes
# activations with one scale per batch tensor, so onnx-int8's vectors do; openvino-int8's do
# by up to 2e-3 with padding on a CPU with AMX, though not on one without: reports/embedding.md)
BATCH_INDEPENDENT = ("torch", "onnx", "openvino")
EXPORT_VERSION = "2"  # bump when the export changes, so old exports are not reused
# the packages each exported backend needs (the `embed-fast` extra)
NEEDS = {"onnx": ("onnxruntime", "onnx"), "onnx-int8": ("onnxruntime", "onnx"),
         "openvino": ("openvino", "onnx"), "openvino-int8": ("openvino", "nncf", "onnx")}
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def missing_packages(backend: str) -> list[str]:
    import importlib.util

    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # ValueError: blocked (sys.modules[name] is None)
            return True

    return [name for name in NEEDS.get(backend, ()) if missing(name)]


def default_export_root() -> Path:
    env = os.environ.get("BRANCHSEARCH_MODEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "branchsearch" / "models"


def export_key(model_path: Path) -> str:
    """Names one model folder's exports: its name plus a digest of its config and weights
    (size and mtime), so a changed model is exported again."""
    parts = [str(model_path.resolve()), EXPORT_VERSION]
    for name in sorted(os.listdir(model_path)):
        path = model_path / name
        if path.is_file():
            stat = path.stat()
            parts.append(f"{name}:{stat.st_size}:{int(stat.st_mtime)}")
    digest = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
    return f"{model_path.name}-{digest}"


def cpu_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def read_st_config(model_path: Path) -> tuple[int, str]:
    """(max_seq_length, pooling) of a sentence-transformers folder; pooling is mean or cls."""
    max_len = 512
    config = model_path / "sentence_bert_config.json"
    if config.is_file():
        max_len = int(json.loads(config.read_text()).get("max_seq_length") or max_len)
    pooling = "mean"
    for pool_config in model_path.glob("*_Pooling/config.json"):
        conf = json.loads(pool_config.read_text())
        if conf.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif not conf.get("pooling_mode_mean_tokens", True):
            raise ValueError(f"pooling {conf} is not supported by the exported backends")
    return max_len, pooling


# ---- export -------------------------------------------------------------------------------

def ensure_export(model_path: Path, backend: str, root: Path) -> Path:
    """The exported model file for `backend` (exporting it first if needed)."""
    final = root / export_key(model_path) / backend
    target = final / ("model.xml" if backend.startswith("openvino") else "model.onnx")
    if target.is_file():
        return target
    base = ensure_export(model_path, "onnx", root) if backend != "onnx" else None  # all start there
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{backend}-", dir=final.parent))
    try:
        if backend == "onnx":
            export_onnx(model_path, tmp / "model.onnx")
        elif backend == "onnx-int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            # per-channel u8 weights, constant-weight MatMuls only, each layer's FFN output
            # projection kept fp32: per-tensor int8 (sentence-transformers' presets) drops
            # MiniLM's cosine to torch to 0.63-0.90 on this AVX2 machine; quantizing every
            # projection per channel gives min 0.990, keeping the FFN outputs fp32 min 0.994
            import onnx

            keep = [node.name for node in onnx.load(str(base)).graph.node
                    if node.op_type == "MatMul" and "/output/dense/" in node.name
                    and "attention" not in node.name]
            quantize_dynamic(str(base), str(tmp / "model.onnx"), weight_type=QuantType.QUInt8,
                             per_channel=True, op_types_to_quantize=["MatMul"],
                             nodes_to_exclude=keep, extra_options={"MatMulConstBOnly": True})
        elif backend == "openvino":
            import openvino as ov

            ov.save_model(ov.Core().read_model(str(base)), str(tmp / "model.xml"))
        elif backend == "openvino-int8":
            quantize_openvino(model_path, base, tmp / "model.xml")
        else:
            raise ValueError(f"unknown embedding backend {backend!r}")
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same export first
            if not target.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def export_onnx(model_path: Path, out: Path) -> None:
    """transformer + pooling + normalisation -> one ONNX graph: (ids, mask, types) -> (n, dim)."""
    import warnings

    import torch
    from transformers import AutoModel

    _, pooling = read_st_config(model_path)
    model = AutoModel.from_pretrained(str(model_path), attn_implementation="eager").eval()
    if not (hasattr(model, "embeddings") and hasattr(model, "encoder")):
        raise ValueError(f"{type(model).__name__} is not a BERT-style encoder")

    class Pooled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.inner.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
            keep = attention_mask.to(hidden.dtype)
            additive = (1.0 - keep[:, None, None, :]) * torch.finfo(hidden.dtype).min
            out = self.inner.encoder(hidden, attention_mask=additive).last_hidden_state
            if pooling == "cls":
                pooled = out[:, 0]
            else:
                pooled = (out * keep[:, :, None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    example = tuple(torch.ones(2, 8, dtype=torch.long) for _ in INPUTS)
    axes = {name: {0: "batch", 1: "tokens"} for name in INPUTS}
    axes["embedding"] = {0: "batch"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Pooled(model), example, str(out), dynamo=False, input_names=list(INPUTS),
                          output_names=["embedding"], dynamic_axes=axes, opset_version=17)


def quantize_openvino(model_path: Path, onnx_path: Path, out: Path) -> None:
    import nncf
    import openvino as ov

    tokenizer = load_tokenizer(model_path)
    items = []
    texts = calibration_texts(model_path)
    for start in range(0, len(texts), 8):
        items.append(tokenize(tokenizer, texts[start:start + 8]))
    model = ov.Core().read_model(str(onnx_path))
    quantized = nncf.quantize(model, nncf.Dataset(items), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(items))
    ov.save_model(quantized, str(out))


CALIBRATION_PASSAGES = (
    "Alterations of the architecture of cerebral white matter in the developing human brain can "
    "affect cortical development and result in functional disabilities.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "Who directed the film that won the Academy Award for Best Picture in 1998?",
    "Mitochondria generate most of the chemical energy needed to power the cell's reactions.",
    "The company reported quarterly revenue of 4.2 billion dollars, up 12 percent year on year.",
    "def search(query, k=10): return index.top_k(embed(query), k)",
    "Vaccination reduced the incidence of measles by more than 90 percent in the cohort studied.",
    "The river rises in the Alps and flows north through Switzerland and Germany to the sea.",
    "She was born in 1867 in Warsaw and later moved to Paris, where she studied physics.",
    "Randomised controlled trials found no significant effect of vitamin D on fracture risk.",
    "What is the capital of the country where the composer of the opera was born?",
    "The band released their debut album in 2003 on an independent label based in Seattle.",
)


def calibration_texts(model_path: Path) -> list[str]:
    """Local, fixed calibration text: the passages above and paragraphs of the model card."""
    texts = list(CALIBRATION_PASSAGES)
    card = model_path / "README.md"
    if card.is_file():
        paragraphs = [p.strip() for p in card.read_text(errors="ignore").split("\n\n")]
        texts += [p for p in paragraphs if len(p) > 40][:84]
    return texts


# ---- run ----------------------------------------------------------------------------------

def load_tokenizer(model_path: Path):
    from tokenizers import Tokenizer

    max_len, _ = read_st_config(model_path)
    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_len)
    pad_id = tokenizer.padding["pad_id"] if tokenizer.padding else (tokenizer.token_to_id("[PAD]") or 0)
    tokenizer.enable_padding(pad_id=pad_id)
    return tokenizer


def tokenize(tokenizer, texts: Sequence[str]) -> dict:
    import numpy as np

    encodings = tokenizer.encode_batch(list(texts))
    return {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}


class ExportedEncoder:
    """encode(texts, batch_size) -> L2-normalised float32 (n, dim), by ONNX Runtime or OpenVINO.
    Texts are batched longest first (less padding), as sentence-transformers does."""

    def __init__(self, model_path: Path, backend: str, root: Path, threads: int | None = None):
        self.backend = backend
        self.path = ensure_export(model_path, backend, root)
        self.tokenizer = load_tokenizer(model_path)
        threads = threads or cpu_threads()
        if backend.startswith("onnx"):
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            # no busy-waiting between ops: on a shared machine (Ray actors, other processes)
            # spinning threads burn the cores the others need
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(self.path), options,
                                           providers=["CPUExecutionProvider"])
            names = {i.name for i in session.get_inputs()}
            self._run = lambda feed: session.run(
                None, {k: v for k, v in feed.items() if k in names})[0]
        else:
            import openvino as ov

            # f32 arithmetic: on CPUs with AMX / AVX512-BF16 OpenVINO defaults to bf16, whose
            # vectors differ from torch's by up to 2e-3 and change with the batch (measured on
            # such a machine); the int8 model keeps its int8 layers either way
            compiled = ov.Core().compile_model(str(self.path), "CPU", {
                "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
                "INFERENCE_PRECISION_HINT": "f32"})
            request = compiled.create_infer_request()
            names = {i.get_any_name() for i in compiled.inputs}
            self._run = lambda feed: request.infer(
                {k: v for k, v in feed.items() if k in names})[compiled.output(0)].copy()
        self.dim = int(self.encode(["dimension probe"], 1).shape[1])

    def encode(self, texts: Sequence[str], batch_size: int):
        import numpy as np

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = None
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            vectors = np.asarray(self._run(tokenize(self.tokenizer, [texts[i] for i in idx])),
                                 dtype=np.float32)
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[idx] = vectors
        return out
