"""Export: checkpoint -> bundle, for both attention kinds, checked against PyTorch and ONNX Runtime."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import TINY_N_MAX, make_tiny_checkpoint

from export.classify import export_classifier, load_classifier
from training.provenance import sha256_of


@pytest.fixture(scope="module", params=["linformer", "transformer", "linformer-mean", "performer"])
def exported(request, tmp_path_factory):
    """All three attention kinds; the Linformer with a learned E and with mean pooling."""
    scratch = tmp_path_factory.mktemp(request.param)
    attention, _, projection = request.param.partition("-")
    checkpoint, tokenizer = make_tiny_checkpoint(scratch / "source", attention, projection or "linear")
    bundle = scratch / f"classify-{request.param}"
    config = export_classifier(checkpoint, tokenizer, bundle, bundle.name)
    return checkpoint, bundle, config


def run(bundle, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]


def test_bundle_states_its_contract_and_every_file_is_in_the_manifest(exported):
    _, bundle, config = exported
    assert config["n_max"] == TINY_N_MAX and config["task"] == "classify"
    assert json.loads((bundle / "config.json").read_text()) == config
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    assert set(manifest) == {"config.json", "model.onnx", "tokenizer.model", "MODEL_CARD.md"}
    assert all(sha256_of(bundle / name) == digest for name, digest in manifest.items())
    assert "Parity" in (bundle / "MODEL_CARD.md").read_text()


def test_softmax_attention_kinds_use_ort_fused_attention_and_the_performer_plain_ops(exported):
    _, _, config = exported
    fused = config["export"]["fused_operators"]
    # Linformer and vanilla: one MultiHeadAttention per layer; FAVOR+ has no softmax attention to fuse
    assert fused.get("MultiHeadAttention", 0) == (0 if config["attention"] == "performer" else 2)
    assert "SkipLayerNormalization" not in fused  # slower on CPU: export/classify.py


def test_performer_bundle_holds_its_random_features_and_exports_deterministically(tmp_path):
    import onnx
    from onnx import numpy_helper

    checkpoint, tokenizer = make_tiny_checkpoint(tmp_path / "source", "performer")
    bundle = tmp_path / "classify-performer"
    config = export_classifier(checkpoint, tokenizer, bundle, bundle.name)

    model, _ = load_classifier(checkpoint)
    features = [t for name, t in model.state_dict().items() if name.endswith("features.weight")]
    assert config["n_features"] == features[0].shape[0]
    constants = [numpy_helper.to_array(t) for t in onnx.load(bundle / "model.onnx").graph.initializer]
    d_head = model.cfg.d_model // model.cfg.n_heads
    for w in features:  # as the graph uses it, folded by the exporter: W^T hd^-1/4 (model.linformer.RandomFeatures)
        used = (w.T * d_head**-0.25).numpy()
        assert any(c.shape == used.shape and np.allclose(c, used, rtol=1e-6, atol=0) for c in constants)
    export_classifier(checkpoint, tokenizer, tmp_path / "again", bundle.name)
    assert sha256_of(tmp_path / "again" / "model.onnx") == sha256_of(bundle / "model.onnx")


@pytest.mark.parametrize("n", [1, 5, 33, TINY_N_MAX])
def test_onnx_logits_match_pytorch_at_every_length_up_to_n_max(exported, n):
    checkpoint, bundle, _ = exported
    model, _ = load_classifier(checkpoint)
    ids = torch.randint(4, model.cfg.vocab_size, (3, n))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(ids, mask).numpy()
    np.testing.assert_allclose(run(bundle, ids.numpy(), mask.numpy()), expected, atol=1e-4, rtol=0)


def test_padded_batch_equals_one_at_a_time_in_the_exported_graph(exported):
    _, bundle, _ = exported
    rng = np.random.default_rng(0)
    lengths = [3, 40, TINY_N_MAX, 17]
    ids = np.zeros((4, TINY_N_MAX), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n] = rng.integers(4, 70, n), 1
    batched = run(bundle, ids, mask)
    for row, n in enumerate(lengths):
        alone = run(bundle, ids[row : row + 1, :n], mask[row : row + 1, :n])
        np.testing.assert_allclose(batched[row], alone[0], atol=1e-5, rtol=0)


def test_input_longer_than_n_max_is_an_error_not_a_silent_answer(exported):
    _, bundle, _ = exported
    ids = np.full((1, TINY_N_MAX + 1), 5, dtype=np.int64)
    with pytest.raises(Exception, match=r"(?i)(broadcast|shape|dimension)"):
        run(bundle, ids, np.ones_like(ids))
