"""Shared fixtures: a tiny but real classify bundle (ONNX + SentencePiece), and clients for the service."""

import io
import random
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

TINY_N_MAX = 64
WORDS = (
    "the a film movie story actor plot scene music ending great good wonderful moving brilliant fun "
    "bad boring awful dull slow weak long short funny sad dark bright old new love hate watch again "
    "never always really quite very not too much little best worst character director script camera"
).split()


def _train_tokenizer(path: Path) -> int:
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=120, model_type="unigram",
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()


def make_tiny_checkpoint(scratch: Path, attention: str = "linformer", projection: str = "linear") -> tuple[Path, Path]:
    """An untrained 2-layer classifier checkpoint (n_max = TINY_N_MAX) and its tokenizer, as training writes."""
    from dataclasses import asdict

    import torch

    from model import Classifier, ModelConfig
    from training.trainer import TrainConfig

    scratch.mkdir(parents=True, exist_ok=True)
    vocab_size = _train_tokenizer(scratch / "tokenizer.model")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size, n_max=TINY_N_MAX, d_model=32, n_heads=2, n_layers=2, d_ff=64, k=16,
                      attention=attention, projection=projection)  # fmt: skip
    checkpoint = scratch / f"untrained-{attention}-{projection}.pt"
    torch.save({"model": Classifier(cfg).state_dict(), "model_config": asdict(cfg),
                "train_config": asdict(TrainConfig(out_dir="untrained", epochs=0)),
                "extra": {"labels": ["negative", "positive"]}}, checkpoint)  # fmt: skip
    return checkpoint, scratch / "tokenizer.model"


def build_tiny_classify_bundle(path: Path) -> Path:
    """A real Linformer bundle made by export/ (fused attention, parity-checked) from an untrained model."""
    from export.classify import export_classifier

    path = Path(path)
    checkpoint, tokenizer = make_tiny_checkpoint(path.parent / f"{path.name}-source")
    export_classifier(checkpoint, tokenizer, path, path.name)
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """A models/ directory holding one classify bundle, `classify-linformer` (read-only for tests)."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_classify_bundle(root / "classify-linformer")
    return root


@pytest.fixture(scope="session")
def translate_models_dir(tmp_path_factory) -> Path:
    """A models/ directory holding one translation bundle, `translate-linformer` (read-only for tests)."""
    root = tmp_path_factory.mktemp("translate-models")
    build_tiny_translate_bundle(root / "translate-linformer")
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

    # the lifespan runs on the test's own thread here: it stays SCHED_OTHER (else the processes later tests start
    # would inherit SCHED_BATCH in every thread)
    defaults = {"models_dir": models_dir, "ort_intra_op_threads": 1, "log_level": "warning",
                "event_loop_sched_batch": False}
    return Settings(_env_file=None, **{**defaults, **overrides})


def make_tiny_translate_checkpoint(scratch: Path, attention: str = "linformer") -> tuple[Path, Path]:
    """An untrained 2+2-layer Translator checkpoint (n_max = TINY_N_MAX, tgt_n_max 16) and its tokenizer."""
    from dataclasses import asdict

    import torch

    from model import ModelConfig, Translator
    from training.trainer import TrainConfig

    scratch.mkdir(parents=True, exist_ok=True)
    vocab_size = _train_tokenizer(scratch / "tokenizer.model")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size, n_max=TINY_N_MAX, d_model=32, n_heads=2, n_layers=2, d_ff=64, k=16,
                      attention=attention, n_decoder_layers=2, tgt_n_max=16, cross_attention=attention,
                      k_cross=8)  # fmt: skip
    checkpoint = scratch / f"untrained-translate-{attention}.pt"
    torch.save({"model": Translator(cfg).state_dict(), "model_config": asdict(cfg),
                "train_config": asdict(TrainConfig(out_dir="untrained", epochs=0)),
                "extra": {"task": "translate"}}, checkpoint)  # fmt: skip
    return checkpoint, scratch / "tokenizer.model"


def build_tiny_translate_bundle(path: Path, attention: str = "linformer") -> tuple[Path, Path]:
    """A real translation bundle made by export/ (parity-checked) from an untrained Translator; returns the
    bundle and the checkpoint it came from (for comparisons with PyTorch decoding)."""
    import sentencepiece as spm

    from export.translate import export_translator

    path = Path(path)
    checkpoint, tokenizer = make_tiny_translate_checkpoint(path.parent / f"{path.name}-source", attention)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    sources = [sp.encode(text) + [3] for text in ("the film was great", "a bad movie", "never again watch")]
    export_translator(checkpoint, tokenizer, path, path.name, sources)
    return path, checkpoint
