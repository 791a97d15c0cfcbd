"""/translate through HTTP, on a tiny real bundle (encoder.onnx + decoder.onnx with a KV cache) exported
from an untrained Translator, compared with PyTorch decoding of the same checkpoint."""

import asyncio

import pytest
import sentencepiece as spm
import torch
from conftest import TINY_N_MAX, build_tiny_translate_bundle, make_settings, running_service

from export.translate import load_translator
from training.batching import pad
from training.decode import beam_search, greedy
from training.tokenizer import EOS_ID, PAD_ID

pytestmark = pytest.mark.anyio

TEXTS = ["the film was great", "a bad movie", "never watch this film again, it was long and slow", "fun"]


@pytest.fixture(scope="module")
def translate_models(tmp_path_factory):
    """A models/ directory holding `translate-linformer`, and the checkpoint it was exported from."""
    root = tmp_path_factory.mktemp("translate-models")
    bundle, checkpoint = build_tiny_translate_bundle(root / "translate-linformer")
    return root, bundle, checkpoint


class CountingRuntime:
    """Passes batches to the real translation runtime and records their sizes and options."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.batches: list[tuple[int, object]] = []

    def run(self, input_ids, attention_mask, options, between_steps=None):
        self.batches.append((len(input_ids), options))
        return self.runtime.run(input_ids, attention_mask, options, between_steps)


@pytest.fixture
async def client(translate_models):
    root, _, _ = translate_models
    # a translate-only deployment: the empty classify model name means "not configured"
    async with running_service(make_settings(root, classify_model="", max_texts_per_request=8)) as c:
        yield c


def torch_translations(checkpoint, bundle, texts: list[str], beam_size: int = 1, max_new_tokens: int = 256):
    model, _ = load_translator(checkpoint)
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer.model"))
    src_ids, src_mask = pad([sp.encode(t) + [EOS_ID] for t in texts], PAD_ID)
    with torch.no_grad():
        if beam_size == 1:
            outputs = greedy(model, src_ids, src_mask, max_new_tokens)
        else:
            outputs = beam_search(model, src_ids, src_mask, beam_size, max_new_tokens)
    return [{"text": sp.decode(ids), "tokens": len(ids)} for ids in outputs]


async def test_translate_answers_each_text_in_order(client):
    r = await client.post("/translate", json={"texts": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "translate-linformer"
    assert len(body["translations"]) == len(TEXTS)
    for translation in body["translations"]:
        assert set(translation) == {"text", "tokens"} and isinstance(translation["text"], str)
        assert 0 <= translation["tokens"] <= 16  # the tiny model's tgt_n_max


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_service_output_equals_pytorch_decoding_of_the_same_checkpoint(client, translate_models, beam_size):
    _, bundle, checkpoint = translate_models
    r = await client.post("/translate", json={"texts": TEXTS, "beam_size": beam_size})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == torch_translations(checkpoint, bundle, TEXTS, beam_size)


@pytest.mark.parametrize("beam_size", [1, 2])
async def test_batched_translations_equal_one_at_a_time(translate_models, beam_size):
    root, _, _ = translate_models
    runtimes = []

    def wrap(runtime):
        runtimes.append(CountingRuntime(runtime))
        return runtimes[-1]

    settings = make_settings(root, max_wait_ms=200, max_batch_size=8, translate_scheduling="request")
    async with running_service(settings, wrap_runtime=wrap) as client:
        alone = [(await client.post("/translate", json={"text": t, "beam_size": beam_size})).json() for t in TEXTS]
        runtimes[0].batches.clear()
        together = await asyncio.gather(
            *(client.post("/translate", json={"text": t, "beam_size": beam_size}) for t in TEXTS)
        )
    assert [r.json() for r in together] == alone
    assert max(size for size, _ in runtimes[0].batches) > 1, "the concurrent requests should share a batch"


async def test_requests_with_different_options_are_never_batched_together(translate_models):
    root, _, _ = translate_models
    runtimes = []

    def wrap(runtime):
        runtimes.append(CountingRuntime(runtime))
        return runtimes[-1]

    # whole-request batches, none cutting in (a cut-in of short requests may mix options: test_step_batching.py)
    settings = make_settings(root, max_wait_ms=200, translate_scheduling="request", translate_cut_in_ratio=0)
    async with running_service(settings, wrap_runtime=wrap) as client:
        runtimes[0].batches.clear()
        payloads = [{"text": t, "beam_size": 1 + i % 2} for i, t in enumerate(TEXTS)]
        responses = await asyncio.gather(*(client.post("/translate", json=p) for p in payloads))
    assert all(r.status_code == 200 for r in responses)
    assert {options for _, options in runtimes[0].batches} == {(1, 256), (2, 256)}
    assert sum(size for size, _ in runtimes[0].batches) == len(TEXTS)


async def test_max_new_tokens_bounds_the_translation(client, translate_models):
    _, bundle, checkpoint = translate_models
    r = await client.post("/translate", json={"texts": TEXTS, "max_new_tokens": 3})
    assert r.status_code == 200, r.text
    translations = r.json()["translations"]
    assert all(t["tokens"] <= 3 for t in translations)
    assert translations == torch_translations(checkpoint, bundle, TEXTS, max_new_tokens=3)


async def test_text_over_n_max_is_413_unless_truncate(client):
    long_text = " ".join(["film"] * (TINY_N_MAX + 5))
    r = await client.post("/translate", json={"text": long_text})
    assert r.status_code == 413
    assert str(TINY_N_MAX) in r.json()["error"]["message"]
    r = await client.post("/translate", json={"text": long_text, "truncate": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "payload",
    [
        {"text": ""},
        {"texts": []},
        {"texts": ["fine", "  "]},
        {"text": "ok", "beam_size": 0},
        {"text": "ok", "beam_size": 9},
        {"text": "ok", "max_new_tokens": 0},
        {"text": "ok", "beam_size": "2"},
    ],
)
async def test_invalid_requests_are_422(client, payload):
    assert (await client.post("/translate", json=payload)).status_code == 422


async def test_models_endpoint_lists_the_translation_bundle(client):
    models = (await client.get("/v1/models")).json()["models"]
    assert [(m["name"], m["task"], m["serving"]) for m in models] == [("translate-linformer", "translate", True)]
    assert (await client.get("/readyz")).status_code == 200
