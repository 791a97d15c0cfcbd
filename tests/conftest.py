"""Shared fixtures: a tiny but real classify bundle (ONNX + SentencePiece), and clients for the service."""

import hashlib
import io
import json
import random
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

TINY_N_MAX = 64
WORDS = (
    "the a film movie story actor plot scene music ending great good wonderful moving brilliant fun "
    "bad boring awful dull slow weak long short funny sad dark bright old new love hate watch again "
    "never always really quite very not too much little best worst character director script camera"
).split()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(bundle_dir: Path) -> None:
    files = {p.name: _sha256(p) for p in sorted(bundle_dir.iterdir()) if p.name != "manifest.json"}
    (bundle_dir / "manifest.json").write_text(json.dumps({"files": files}, indent=2))


def _train_tokenizer(path: Path) -> int:
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=120, model_type="unigram",
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()


def _write_masked_mean_classifier(path: Path, vocab_size: int, dim: int = 16, num_labels: int = 2) -> None:
    """ids, mask [B, S] -> embed -> mean over unmasked positions -> tanh -> linear -> logits [B, labels]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (vocab_size, dim)).astype(np.float32), "embedding"),
        numpy_helper.from_array(rng.normal(0, 1, (dim, num_labels)).astype(np.float32), "w_out"),
        numpy_helper.from_array(rng.normal(0, 0.1, (num_labels,)).astype(np.float32), "b_out"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
    ]
    node = helper.make_node
    nodes = [
        node("Gather", ["embedding", "input_ids"], ["embedded"]),  # (B, S, D)
        node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),  # (B, S)
        node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),  # (B, S, 1)
        node("Mul", ["embedded", "mask3"], ["masked"]),
        node("ReduceSum", ["masked", "seq_axis"], ["summed"], keepdims=0),  # (B, D)
        node("ReduceSum", ["mask", "seq_axis"], ["count"], keepdims=1),  # (B, 1)
        node("Max", ["count", "one"], ["safe_count"]),
        node("Div", ["summed", "safe_count"], ["mean"]),
        node("Tanh", ["mean"], ["hidden"]),
        node("MatMul", ["hidden", "w_out"], ["projected"]),
        node("Add", ["projected", "b_out"], ["logits"]),  # (B, num_labels)
    ]
    graph = helper.make_graph(
        nodes, "tiny_masked_mean_classifier",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_labels])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # onnx 1.23 writes IR 14 by default, which onnxruntime 1.31 refuses
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_tiny_classify_bundle(path: Path) -> Path:
    """A real bundle per the export contract, small enough to build in a second. Swap for export/'s later."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = _train_tokenizer(path / "tokenizer.model")
    _write_masked_mean_classifier(path / "model.onnx", vocab_size)
    config = {
        "name": path.name, "task": "classify", "attention": "transformer", "n_max": TINY_N_MAX, "k": None,
        "sharing": "layerwise", "projection": "linear", "labels": ["negative", "positive"],
        "special_tokens": {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3},
        "add_bos": True, "add_eos": False, "onnx": {"model": "model.onnx"},
        "model_config": {"vocab_size": vocab_size, "dim": 16}, "versions": {}, "metrics": {},
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "MODEL_CARD.md").write_text("# tiny test bundle\n\nMasked-mean embedding classifier for tests.\n")
    write_manifest(path)
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """A models/ directory holding one classify bundle, `classify-linformer` (read-only for tests)."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_classify_bundle(root / "classify-linformer")
    return root


@pytest.fixture
def anyio_backend():
    return "asyncio"


class SlowRuntime:
    """Test double around the real runtime: each batch takes at least `delay_s`, and rows are counted."""

    def __init__(self, runtime, delay_s: float):
        self.runtime, self.delay_s = runtime, delay_s
        self.batches: list[int] = []  # batch sizes actually computed

    def run(self, input_ids, attention_mask):
        time.sleep(self.delay_s)
        self.batches.append(len(input_ids))
        return self.runtime.run(input_ids, attention_mask)


@asynccontextmanager
async def running_service(settings, wrap_runtime=None):
    """The app with its lifespan (models loaded, batchers running) and an HTTP client bound to it."""
    from service.app import create_app

    app = create_app(settings, wrap_runtime=wrap_runtime)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            yield client


def make_settings(models_dir: Path, **overrides):
    from service.config import Settings

    defaults = {"models_dir": models_dir, "ort_intra_op_threads": 1, "log_level": "warning"}
    return Settings(_env_file=None, **{**defaults, **overrides})
