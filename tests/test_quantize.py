"""int8 bundles: `python -m export quantize` on tiny exported bundles, checked against their fp32 source and
loaded by the service exactly as a deployment selects them (LINFORMER_CLASSIFY_MODEL / _TRANSLATE_MODEL)."""

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import TINY_N_MAX, build_tiny_translate_bundle, make_settings, make_tiny_checkpoint, running_service

from export.__main__ import main as export_main
from export.classify import export_classifier
from export.quantize import quantize_bundle
from service.bundle import load_bundle
from training.provenance import sha256_of

# Measured on these untrained tiny models (d_model 32, seeds fixed in conftest): the largest |int8 - fp32| logit
# difference was 0.4-1.6 % of the largest fp32 logit for the classifiers and 1.2 % for the translator's decoder
# over 4 cached steps. Per-tensor int8 weights have a step of max|w| / 127 and the activations are rounded to
# 1/255 of their range on every call, so errors of about 1 % are what dynamic quantisation costs. 5 % leaves
# headroom and still catches a wrongly scaled or transposed weight (errors of the order of the logits).
RELATIVE_LOGIT_TOLERANCE = 0.05


@pytest.fixture(scope="module", params=["linformer", "transformer"])
def classify_pair(request, tmp_path_factory):
    """models/ with `classify-<kind>` (fp32, exported from an untrained checkpoint) and its int8 twin."""
    root = tmp_path_factory.mktemp(f"quantize-{request.param}")
    checkpoint, tokenizer = make_tiny_checkpoint(root.parent / f"{root.name}-source", request.param)
    fp32 = root / f"classify-{request.param}"
    export_classifier(checkpoint, tokenizer, fp32, fp32.name)
    int8 = root / f"{fp32.name}-int8"
    export_main(["quantize", "--bundle", str(fp32), "--out", str(int8)])  # the command the README gives
    return root, fp32, int8


@pytest.fixture(scope="module")
def translate_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize-translate")
    fp32, _ = build_tiny_translate_bundle(root / "translate-linformer")
    int8 = root / "translate-linformer-int8"
    quantize_bundle(fp32, int8)
    return root, fp32, int8


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_int8_bundle_verifies_and_names_the_fp32_bundle_it_came_from(classify_pair):
    _, fp32, int8 = classify_pair
    bundle = load_bundle(int8)  # the service's own check: every file matches manifest.json
    manifest = json.loads((int8 / "manifest.json").read_text())["files"]
    assert set(manifest) == {"config.json", "model.onnx", "tokenizer.model", "MODEL_CARD.md"}
    quantization = bundle.config["export"]["quantization"]
    assert quantization["method"] == "onnxruntime.quantization.quantize_dynamic"
    assert quantization["fp32_bundle"]["name"] == fp32.name
    assert quantization["fp32_bundle"]["manifest_sha256"] == sha256_of(fp32 / "manifest.json")
    assert quantization["fp32_bundle"]["onnx_sha256"]["model.onnx"] == sha256_of(fp32 / "model.onnx")
    assert bundle.name == int8.name and bundle.n_max == TINY_N_MAX
    assert sha256_of(int8 / "tokenizer.model") == sha256_of(fp32 / "tokenizer.model")
    assert "int8" in (int8 / "MODEL_CARD.md").read_text().splitlines()[2]


def test_every_dense_layer_is_int8_and_the_fused_attention_stays(classify_pair):
    _, fp32, int8 = classify_pair
    weights = {init.name for init in onnx.load(str(fp32 / "model.onnx")).graph.initializer}
    dense = [n for n in onnx.load(str(fp32 / "model.onnx")).graph.node
             if n.op_type in ("MatMul", "Gemm") and any(name in weights for name in n.input)]  # fmt: skip
    ops = [n.op_type for n in onnx.load(str(int8 / "model.onnx")).graph.node]
    assert ops.count("MatMulInteger") == len(dense) == 13  # 2 layers x (q, k, v, out, fc, proj) + the head
    assert ops.count("MultiHeadAttention") == 2
    recorded = json.loads((int8 / "config.json").read_text())["export"]["quantization"]["ops"]["model.onnx"]
    assert recorded["int8_matmul"] == 13 and recorded["fp32_multihead_attention"] == 2


@pytest.mark.parametrize("n", [1, 17, TINY_N_MAX])
def test_int8_logits_stay_close_to_fp32(classify_pair, n):
    _, fp32, int8 = classify_pair
    rng = np.random.default_rng(n)
    vocab_size = load_bundle(fp32).config["model_config"]["vocab_size"]
    feeds = {"input_ids": rng.integers(4, vocab_size, (8, n)), "attention_mask": np.ones((8, n), np.int64)}
    feeds["attention_mask"][1, n // 2 + 1 :] = 0  # a padded row too
    expected = session(fp32 / "model.onnx").run(["logits"], feeds)[0]
    got = session(int8 / "model.onnx").run(["logits"], feeds)[0]
    assert np.abs(got - expected).max() < RELATIVE_LOGIT_TOLERANCE * np.abs(expected).max()
    assert np.abs(got - expected).max() > 0  # it really is a different (quantised) graph


def test_translate_int8_decoder_has_its_dense_layers_in_int8(translate_pair):
    _, _, int8 = translate_pair
    ops = load_bundle(int8).config["export"]["quantization"]["ops"]
    # 2 layers x (self q;k;v as one, out; cross q, out; fc, proj) + the tied output layer: reached only because
    # the step decoder's weight transposes (and the q;k;v Concat) are folded first
    assert ops["decoder.onnx"]["int8_matmul"] == 2 * 6 + 1
    decoder_ops = [n.op_type for n in onnx.load(str(int8 / "decoder.onnx")).graph.node]
    assert decoder_ops.count("MatMulInteger") == 13
    assert ops["encoder.onnx"]["int8_matmul"] == 2 * 6 + 2 * 2  # encoder layers + each decoder layer's cross k, v


def decoder_logits(bundle, texts: list[str], steps: int) -> list[np.ndarray]:
    """Encode `texts`, then `steps` cached decoder calls fed token 4, 5, ...: the logits of every call."""
    import sentencepiece as spm

    from export.step_decoder import step_logits

    config = load_bundle(bundle).config
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer.model"))
    ids = [sp.encode(text) + [config["special_tokens"]["eos_id"]] for text in texts]
    input_ids = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = seq
    forced = np.array([[config["special_tokens"]["bos_id"]] + [3 + step for step in range(1, steps)]] * len(ids))
    logits, _ = step_logits(session(bundle / "encoder.onnx"), session(bundle / "decoder.onnx"), config, input_ids,
                            (input_ids > 0).astype(np.int64), steps, forced=forced)  # fmt: skip
    return list(logits)


def test_translate_int8_logits_stay_close_to_fp32_over_cached_steps(translate_pair):
    _, fp32, int8 = translate_pair
    texts = ["the film was great", "a bad movie", "never watch this film again, it was long and slow"]
    for expected, got in zip(decoder_logits(fp32, texts, 4), decoder_logits(int8, texts, 4), strict=True):
        assert 0 < np.abs(got - expected).max() < RELATIVE_LOGIT_TOLERANCE * np.abs(expected).max()


def test_quantize_refuses_a_bundle_that_does_not_match_its_manifest(classify_pair, tmp_path):
    _, fp32, _ = classify_pair
    tampered = tmp_path / "tampered"
    shutil.copytree(fp32, tampered)
    (tampered / "tokenizer.model").write_bytes(b"not the tokenizer")
    with pytest.raises(ValueError, match="does not match"):
        quantize_bundle(tampered, tmp_path / "out")


def test_quantize_refuses_to_quantise_twice(classify_pair, tmp_path):
    _, _, int8 = classify_pair
    with pytest.raises(ValueError, match="already quantised"):
        quantize_bundle(int8, tmp_path / "out")


@pytest.mark.anyio
async def test_service_serves_the_int8_classifier_selected_by_name(classify_pair):
    root, fp32, int8 = classify_pair
    texts = {"texts": ["a wonderful moving film", "boring awful plot, the worst script"]}
    async with running_service(make_settings(root, classify_model=fp32.name)) as client:
        reference = (await client.post("/classify", json=texts)).json()
    async with running_service(make_settings(root, classify_model=int8.name)) as client:
        response = await client.post("/classify", json=texts)
        models = (await client.get("/v1/models")).json()
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == int8.name and int8.name in json.dumps(models)
    for got, expected in zip(body["results"], reference["results"], strict=True):
        assert got["tokens"] == expected["tokens"]
        for label, score in expected["scores"].items():
            assert abs(got["scores"][label] - score) < 0.01  # probabilities move less than the logits


@pytest.mark.anyio
async def test_service_serves_the_int8_translator_selected_by_name(translate_pair):
    root, _, int8 = translate_pair
    async with running_service(make_settings(root, translate_model=int8.name)) as client:
        response = await client.post("/translate", json={"texts": ["the film was great", "a bad movie"]})
    assert response.status_code == 200
    body = response.json()
    assert body["model"] == int8.name and len(body["translations"]) == 2
    assert all(t["tokens"] >= 0 and isinstance(t["text"], str) for t in body["translations"])
