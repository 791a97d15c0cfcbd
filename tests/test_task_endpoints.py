"""POST /classify and /translate are served by plain ASGI endpoints in front of FastAPI (TaskEndpoint); each must
answer exactly as its documented FastAPI route does: the same results, the same status codes, the one error shape."""

import httpx
import pytest
from conftest import make_settings, running_service

pytestmark = pytest.mark.anyio

BODIES = {
    "one text": b'{"text": "the film was great"}',
    "several texts": b'{"texts": ["bad boring awful", "a moving story", "the music"]}',
    "truncated": b'{"texts": ["' + b"the film " * 80 + b'"], "truncate": true}',
    "too long": b'{"texts": ["short", "' + b"the film " * 80 + b'"]}',
    "too many texts": b'{"texts": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}',
    "empty text": b'{"text": " "}',
    "both fields": b'{"text": "a", "texts": ["b"]}',
    "wrong type": b'{"texts": ["ok", 3]}',
    "unknown field": b'{"text": "ok", "extra": 1}',
    "NaN and a lone surrogate": b'{"texts": ["fine", "\\ud800", 5], "extra": NaN}',
    "not JSON": b'{"texts": ["a",',
    "not UTF-8": b'{"text": "\xff\xfe"}',
    "a JSON list": b'["a", "b"]',
    "JSON null": b"null",
    "empty body": b"",
}
TRANSLATE_BODIES = {
    "beam search": b'{"texts": ["a bad movie", "the film"], "beam_size": 3, "max_new_tokens": 5}',
    "over the decode budget": b'{"texts": ["a", "b"], "beam_size": 8}',
    "beam too wide": b'{"text": "a", "beam_size": 9}',
    "Infinity tokens": b'{"text": "a", "max_new_tokens": Infinity}',
    "integral float": b'{"text": "a", "max_new_tokens": 4.0}',
}
CASES = [("/classify", name, body) for name, body in BODIES.items()] + [
    ("/translate", name, body) for name, body in {**BODIES, **TRANSLATE_BODIES}.items()
]


@pytest.fixture(params=["/classify", "/translate"])
async def clients(request, models_dir, translate_models_dir):
    """(route, the server's path, FastAPI's own route) over one app: the last skips the request middleware."""
    if request.param == "/classify":
        settings = make_settings(models_dir, translate_model="", max_texts_per_request=8)
    else:  # a decode budget of 32 tokens: two texts at beam 8 (x 16, the tiny model's target length) go over it
        settings = make_settings(translate_models_dir, classify_model="", max_texts_per_request=8,
                                 max_decode_tokens_per_request=32)  # fmt: skip
    async with running_service(settings) as client:
        await client.get("/healthz")  # builds the middleware stack
        app = client._transport.app
        framework = app.request_context.app  # FastAPI's own middleware stack and routes

        async def without_request_middleware(scope, receive, send):
            scope["app"] = app  # as Starlette sets it before the stack
            await framework(scope, receive, send)

        transport = httpx.ASGITransport(app=without_request_middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as direct:
            yield request.param, client, direct


@pytest.mark.parametrize("clients, body", [(route, body) for route, _, body in CASES],
                         ids=[f"{route} {name}" for route, name, _ in CASES], indirect=["clients"])  # fmt: skip
async def test_the_endpoint_answers_as_the_fastapi_route(clients, body):
    route, served, documented = clients
    headers = {"content-type": "application/json"}
    ours = await served.post(route, content=body, headers=headers)
    theirs = await documented.post(route, content=body, headers=headers)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    if ours.status_code == 200:
        assert ours.json() == theirs.json()
    else:
        mine, reference = ours.json()["error"], theirs.json()["error"]
        assert mine["code"] == reference["code"]
        assert mine["request_id"] == ours.headers["x-request-id"]
        if "details" in reference:
            assert {tuple(d["loc"]) for d in mine["details"]} >= {tuple(d["loc"]) for d in reference["details"]}


async def test_a_body_that_is_not_json_is_refused_as_fastapi_does(clients):
    route, served, documented = clients
    for client in (served, documented):
        r = await client.post(route, content=b"the film", headers={"content-type": "text/plain"})
        assert r.status_code == 422
        assert r.json()["error"]["code"] == "invalid_request"


async def test_a_compressed_body_is_refused_naming_its_encoding(clients):
    import gzip

    route, served, _ = clients
    body = gzip.compress(b'{"text": "the film"}')
    r = await served.post(route, content=body, headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert "Content-Encoding 'gzip' is not supported" in r.json()["error"]["message"]
    plain = {"content-type": "application/json", "content-encoding": "identity"}
    assert (await served.post(route, content=b'{"text": "the film"}', headers=plain)).status_code == 200


async def test_the_endpoint_counts_its_requests_under_its_route(clients):
    route, served, _ = clients
    await served.post(route, json={"text": "the film"})
    await served.post(route, json={"text": ""})
    metrics = (await served.get("/metrics")).text
    assert f'linformer_requests_total{{route="{route}",status="200"}} 1.0' in metrics
    assert f'linformer_requests_total{{route="{route}",status="422"}} 1.0' in metrics


@pytest.mark.parametrize("rows", [[[0.25, 0.75]], [[1.0, 0.0], [1 / 3, 2 / 3]], [[float("nan"), 0.5]],
                                  [[1e-300, 1.0 - 1e-16]]])  # fmt: skip
def test_a_batch_formats_each_result_as_json_dumps_would(rows):
    """The rows are formatted per batch with repr, not json.dumps: the same bytes, NaN spelled as json does."""
    import json

    from service.routes import classification_json

    labels = ["negative", 'pos"itive']
    for row, fragment in zip(rows, classification_json(rows, labels), strict=True):
        best = max(range(len(row)), key=row.__getitem__)
        scores = dict(zip(labels, row, strict=True))
        expected = json.dumps({"label": labels[best], "score": row[best], "scores": scores})
        assert "{" + fragment + "}" == expected


def test_the_softmax_is_numpys_in_float64_nan_and_infinities_alike():
    """service.runtime.probabilities (math, per row) against the numpy softmax it replaced."""
    import numpy as np

    from service.runtime import probabilities

    def numpy_softmax(logits):
        shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)

    logits = np.random.default_rng(0).normal(scale=20.0, size=(64, 2)).astype(np.float32)
    np.testing.assert_allclose(probabilities(logits), numpy_softmax(logits), rtol=1e-15, atol=0)
    special = np.array([[np.nan, 1.0], [1.0, np.nan], [np.inf, 1.0], [-np.inf, 1.0], [3.0, 3.0]], np.float32)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(probabilities(special), numpy_softmax(special))


async def test_the_answer_is_the_json_of_the_response_model(clients):
    """The JSON built as text parses into the documented response."""
    from service.schemas import ClassifyResponse, TranslateResponse

    route, served, _ = clients
    if route == "/translate":
        answer = await served.post(route, json={"texts": ["a bad movie", "the film was great"], "max_new_tokens": 4})
        response = TranslateResponse.model_validate_json(answer.content)
        assert response.model == "translate-linformer"
        assert [0 < t.tokens <= 4 for t in response.translations] == [True, True]
        return
    answer = await served.post("/classify", json={"texts": ["a moving story", "the film " * 80], "truncate": True})
    response = ClassifyResponse.model_validate_json(answer.content)
    assert [r.truncated for r in response.results] == [False, True]
    assert [r.label == max(r.scores, key=r.scores.get) for r in response.results] == [True, True]
    assert all(abs(sum(r.scores.values()) - 1) < 1e-6 for r in response.results)
