"""The CTranslate2 peer (issue #17): the committed vanilla translator converted from its ONNX initializers decodes
exactly as the service's runtime does, and the peer server speaks the service's /translate JSON."""

import json
from pathlib import Path

import pytest

pytest.importorskip("ctranslate2", reason="the translate-peer extra: pip install -e '.[translate-peer]'")

from benchmarks.ctranslate2_server import CTranslate2Runtime, create_app  # noqa: E402
from benchmarks.int8 import padded, translator  # noqa: E402
from export.ctranslate2 import convert, graph_weights  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "models" / "translate-transformer"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert(BUNDLE, tmp_path_factory.mktemp("ct2") / "translate-transformer")


@pytest.fixture(scope="module")
def sources() -> list[list[int]]:
    """The committed load-test sources (held-out EN-DE test text) of every committed length, as token ids."""
    stored = json.loads((REPO / "loadtest" / "data" / "translate.json").read_text())["texts"]
    texts = [text for length in sorted(stored, key=int) for text in stored[length]]
    return [e.ids for e in Tokenizer.from_bundle(load_bundle(BUNDLE)).encode_all(texts, truncate=True)]


def test_every_onnx_parameter_is_named_and_linear_weights_are_out_by_in():
    weights = {**graph_weights(BUNDLE / "encoder.onnx"), **graph_weights(BUNDLE / "decoder.onnx")}
    assert not [name for name in weights if name.startswith("onnx::")]
    assert weights["encoder.blocks.0.mlp.fc.weight"].shape == (512, 128)  # folded (in, out) turned back
    assert weights["blocks.2.cross_attn.v.weight"].shape == (128, 128)  # from the encoder graph


def test_greedy_output_is_token_identical_to_the_service_runtime(converted, sources):
    bundle = load_bundle(BUNDLE)
    ours, peer = translator(bundle), CTranslate2Runtime(bundle, "float32", 1, model_dir=converted)
    for start in range(0, len(sources), 8):  # padded batches: both must ignore the padding
        batch = padded(sources[start : start + 8], bundle.pad_id)
        expected = ours.run(*batch, (1, 256))
        assert peer.run(*batch, (1, 256)) == expected
        assert all(expected), "an empty translation would make the comparison weak"


def test_a_linformer_bundle_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vanilla attention only"):
        convert(REPO / "models" / "translate-linformer", tmp_path / "out")


def test_peer_server_answers_the_services_translate_json(converted):
    from fastapi.testclient import TestClient

    bundle = load_bundle(BUNDLE)
    client = TestClient(create_app(bundle, CTranslate2Runtime(bundle, "int8", 1, model_dir=converted)))
    reply = client.post("/translate", json={"texts": ["Click the Insert tab.", "Save the document."],
                                            "max_new_tokens": 3})  # fmt: skip
    assert reply.status_code == 200
    body = reply.json()
    assert [t["tokens"] for t in body["translations"]] == [3, 3] and all(t["text"] for t in body["translations"])
    assert client.post("/translate", json={"text": "word " * 400}).status_code == 413
    assert client.post("/translate", json={"text": "word " * 400, "truncate": True}).status_code == 200
    assert client.post("/translate", json={"texts": []}).status_code == 422
    assert client.get("/v1/models").json()["models"][0]["n_max"] == bundle.n_max
