"""The HTTP contract, through the real app, the real ONNX session and the real tokenizer."""

import json
import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import TINY_N_MAX, make_settings, running_service

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(models_dir):
    # a classify-only deployment: the empty translate model name means "not configured"
    settings = make_settings(models_dir, translate_model="", max_texts_per_request=8, max_body_bytes=4096)
    async with running_service(settings) as c:
        yield c


async def test_classify_answers_each_text_in_order_with_probabilities(client):
    texts = ["the film was great and moving", "bad boring awful", "a story", "the music"]
    r = await client.post("/classify", json={"texts": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "classify-linformer"
    assert len(body["results"]) == len(texts)
    for result in body["results"]:
        assert set(result["scores"]) == {"negative", "positive"}
        assert sum(result["scores"].values()) == pytest.approx(1.0)
        assert result["label"] == max(result["scores"], key=result["scores"].get)
        assert result["score"] == result["scores"][result["label"]]
        assert result["truncated"] is False
    # order: each text answered alone gives the same result at the same position
    for text, result in zip(texts, body["results"], strict=True):
        alone = (await client.post("/classify", json={"text": text})).json()["results"][0]
        assert alone["scores"] == pytest.approx(result["scores"], abs=1e-6)
        assert alone["tokens"] == result["tokens"]


async def test_text_written_all_in_capitals_is_classified_in_sentence_case(client):
    """A review in capitals was a coin toss (49 % of 500 test reviews right, 82 % in ordinary case): the models
    learnt from ordinarily cased text. It is read in sentence case; any other text as written."""
    shouted, cased = "A MOVING, BEAUTIFULLY ACTED FILM. I LOVED IT!", "A moving, beautifully acted film. I loved it!"
    r = await client.post("/classify", json={"texts": [shouted, cased, "a MOVING film"]})
    assert r.status_code == 200, r.text
    loud, ordinary, mixed = r.json()["results"]
    assert loud == ordinary
    lowered = (await client.post("/classify", json={"text": "a moving film"})).json()["results"][0]
    assert mixed["scores"] != lowered["scores"]  # one word in capitals is read as written


async def test_token_count_includes_bos(client, models_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(models_dir / "classify-linformer" / "tokenizer.model"))
    r = await client.post("/classify", json={"text": "the film"})
    assert r.json()["results"][0]["tokens"] == len(sp.encode("the film")) + 1


@pytest.mark.parametrize(
    "payload",
    [
        {"text": ""},
        {"text": "   "},
        {"texts": []},
        {"texts": ["fine", ""]},
        {},
        {"text": "a", "texts": ["b"]},
        {"text": 5},
        {"texts": "not a list"},
        {"texts": ["ok", 3]},
        {"text": "ok", "truncate": "yes"},
        {"text": "ok", "unknown_field": 1},
        ["a", "b"],
    ],
    ids=lambda p: json.dumps(p)[:40],
)
async def test_bad_input_is_422(client, payload):
    r = await client.post("/classify", json=payload)
    assert r.status_code == 422, r.text


async def test_malformed_json_is_422(client):
    headers = {"content-type": "application/json"}
    r = await client.post("/classify", content=b'{"texts": ["a",', headers=headers)
    assert r.status_code == 422


async def test_too_many_texts_is_422_naming_the_limit(client):
    r = await client.post("/classify", json={"texts": ["the film"] * 9})
    assert r.status_code == 422
    assert "at most 8 texts" in r.text


async def test_text_over_n_max_is_413_naming_the_limit(client):
    r = await client.post("/classify", json={"texts": ["short", "the film " * TINY_N_MAX]})
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert f"n_max={TINY_N_MAX}" in message and "text 1" in message and r.json()["error"]["code"] == "text_too_long"


async def test_truncate_cuts_to_n_max_and_says_so(client):
    r = await client.post("/classify", json={"texts": ["the film " * TINY_N_MAX, "short"], "truncate": True})
    assert r.status_code == 200
    long, short = r.json()["results"]
    assert long["tokens"] == TINY_N_MAX and long["truncated"] is True
    assert short["truncated"] is False


async def test_body_over_limit_is_413(client):
    r = await client.post("/classify", json={"text": "the film " * 1000})  # ~9 KB > 4096
    assert r.status_code == 413
    assert "4096 bytes" in r.json()["error"]["message"]


async def test_chunked_body_over_limit_is_413(client):
    async def chunks():
        yield b'{"text": "'
        for _ in range(100):
            yield b"the film " * 10
        yield b'"}'

    r = await client.post("/classify", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


async def test_translate_is_503_where_it_is_not_configured(client):
    r = await client.post("/translate", json={"text": "Hello world", "beam_size": 4})
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "this server is not configured to translate"
    assert (await client.post("/translate", json={"text": "hi", "beam_size": 9})).status_code == 422


async def test_ops_routes(client):
    assert (await client.get("/healthz")).status_code == 200
    index = (await client.get("/")).json()  # the bare address points at the docs and lists the documented routes
    assert index["docs"] == "/docs" and {"/classify", "/translate", "/readyz"} <= set(index["routes"])
    assert "/" not in index["routes"] and "/metrics" not in index["routes"]
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["models"] == ["classify-linformer"]
    models = (await client.get("/v1/models")).json()["models"]
    assert models == [
        {"name": "classify-linformer", "task": "classify", "attention": "linformer", "n_max": TINY_N_MAX,
         "k": 16, "labels": ["negative", "positive"], "execution_provider": "CPUExecutionProvider",
         "serving": True}
    ]
    assert (await client.get("/docs")).status_code == 200
    assert "/classify" in (await client.get("/openapi.json")).json()["paths"]
    await client.post("/classify", json={"text": "the film"})
    metrics = (await client.get("/metrics")).text
    assert 'linformer_requests_total{route="/classify",status="200"}' in metrics
    for name in ["linformer_batch_size", "linformer_queue_wait_seconds", "linformer_inference_seconds",
                 "linformer_batch_padded_tokens", "linformer_batch_real_tokens", "linformer_queue_depth",
                 "linformer_request_duration_seconds"]:
        assert name in metrics


async def test_request_id_is_echoed_or_created(client):
    r = await client.get("/healthz", headers={"x-request-id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    r = await client.post("/classify", json={"text": ""})
    assert len(r.headers["x-request-id"]) == 32
    r = await client.get("/healthz", headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"] != "bad id\twith spaces"


async def test_without_bundles_the_service_starts_not_ready_and_names_the_models(tmp_path):
    async with running_service(make_settings(tmp_path)) as client:
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["not_loaded"] == ["classify-linformer", "translate-linformer"]
        r = await client.post("/classify", json={"text": "the film"})
        assert r.status_code == 503 and "'classify-linformer' is not available" in r.json()["error"]["message"]
        for body in (ready.text, r.text):  # where the server keeps its files is not the client's business
            assert str(tmp_path) not in body and "/tmp" not in body
        assert (await client.get("/v1/models")).json() == {"models": []}


async def test_corrupt_bundle_refuses_to_start(models_dir, tmp_path):
    from service.app import create_app
    from service.bundle import BundleError

    bundle = shutil.copytree(models_dir / "classify-linformer", tmp_path / "classify-linformer")
    onnx_bytes = bytearray((bundle / "model.onnx").read_bytes())
    onnx_bytes[-1] ^= 0xFF
    (bundle / "model.onnx").write_bytes(bytes(onnx_bytes))
    app = create_app(make_settings(tmp_path))
    with pytest.raises(BundleError, match="model.onnx does not match manifest.json"):
        async with app.router.lifespan_context(app):
            pass


async def test_outputs_match_onnxruntime_directly(client, models_dir):
    """The service adds nothing to the model's numbers: same softmax as a direct session.run."""
    import onnxruntime as ort
    import sentencepiece as spm

    bundle = models_dir / "classify-linformer"
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer.model"))
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    text = "a wonderful moving story"
    ids = np.array([[2, *sp.encode(text)]], dtype=np.int64)
    logits = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0]
    expected = np.exp(logits) / np.exp(logits).sum()
    got = (await client.post("/classify", json={"text": text})).json()["results"][0]["scores"]
    assert [got["negative"], got["positive"]] == pytest.approx(expected.tolist(), abs=1e-6)


def test_service_never_imports_torch_or_onnx():
    import subprocess
    import sys

    code = "import sys, service.app, service.__main__; print(sorted({'torch','onnx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"



def test_the_readme_documents_every_setting_with_its_default():
    from service.config import Settings

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Configuration") : readme.index("## Operating it")]
    cells = dict(re.findall(r"^\| `(LINFORMER_[A-Z_]+)`[^|]*\| ([^|]+?) \|", table, re.M))
    for name, field in Settings.model_fields.items():
        variable = f"LINFORMER_{name.upper()}"
        assert f"`{variable}`" in table, f"{variable} is not in the README's configuration table"
        cell = cells.get(variable, "").strip("`")
        if not cell or " " in cell:  # its default said in words, or in the row of the variable it is paired with
            continue
        default = field.default
        if isinstance(default, bool):
            assert cell == str(default).lower(), variable
        elif isinstance(default, int | float):
            assert float(cell) == default, variable
        else:
            assert cell == str(default), variable


@pytest.mark.parametrize("providers_configured", [False, True])
async def test_fastapis_telemetry_check_is_made_once_at_start_up(models_dir, monkeypatch, providers_configured):
    from service.app import create_app

    app = create_app(make_settings(models_dir, translate_model=""))
    if not hasattr(app, "_native_telemetry"):
        pytest.skip("this FastAPI has no native telemetry: its own call is used, nothing to decide")
    asked = []

    def enabled():
        asked.append(1)
        return providers_configured

    monkeypatch.setattr(app._native_telemetry, "enabled", enabled)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            for _ in range(3):
                response = await client.post("/classify", json={"text": "A fine film."})
                assert response.status_code == 200
    # without providers: asked at start-up only, and requests skip FastAPI's per-request check; with one
    # configured: FastAPI's own call, which asks on every request (and traces it)
    assert app.telemetry_off is not providers_configured
    assert len(asked) == (1 if not providers_configured else 1 + 3)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
async def test_sched_batch_goes_to_the_event_loops_thread_and_not_to_the_models_compute_threads(models_dir):
    """The compute threads start before the lifespan sets the loop's policy (threads inherit it when they start):
    the model's thread must stay SCHED_OTHER, or nothing would be left that a wake-up of the loop does not preempt.
    At shutdown the thread gets its policy back (later tests' servers would inherit it, as would a program's)."""
    before = os.sched_getscheduler(0)  # 0: this thread, the one running the loop
    async with running_service(make_settings(models_dir, event_loop_sched_batch=True)) as client:
        assert (await client.post("/classify", json={"text": "A fine film."})).status_code == 200
        assert os.sched_getscheduler(0) == os.SCHED_BATCH != before
        compute = [thread.native_id for thread in threading.enumerate() if thread.name.startswith("infer-")]
        assert compute and {os.sched_getscheduler(tid) for tid in compute} == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
async def test_a_scheduling_policy_the_operator_chose_for_the_loop_is_left_alone(models_dir):
    """`chrt --batch python -m service` (or any policy other than the default) is the operator's: the lifespan neither
    changes it nor, at shutdown, sets SCHED_OTHER in its place."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # as if started so
    try:
        async with running_service(make_settings(models_dir, event_loop_sched_batch=True)):
            assert os.sched_getscheduler(0) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
