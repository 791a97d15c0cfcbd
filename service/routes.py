"""HTTP routes: validate -> tokenise -> batcher -> decode -> response. No policy lives here."""

import asyncio
from collections.abc import Hashable

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.batcher import BatchFailed, DeadlineExceeded, QueueFull, ShuttingDown
from service.deps import ModelService, ServiceState, State, serving_model
from service.errors import CLIENT_CLOSED_REQUEST, ServiceError, documented
from service.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    ClassifyResult,
    ModelInfo,
    ModelsResponse,
    Readiness,
    TranslateRequest,
    TranslateResponse,
)
from service.tokenizer import TextTooLong

router = APIRouter()

TASK_RESPONSES = documented(413, 422, 429, 499, 500, 503, 504)


# ---- shared steps ----


def _check_text_count(texts: list[str], limit: int) -> None:
    if len(texts) > limit:
        raise RequestValidationError(
            [{"type": "too_long", "loc": ("body", "texts"), "input": len(texts),
              "msg": f"at most {limit} texts per request, got {len(texts)}"}]
        )


def _tokenise(model: ModelService, texts: list[str], truncate: bool):
    try:
        return model.tokenizer.encode_all(texts, truncate=truncate)
    except TextTooLong as e:
        raise ServiceError(413, "text_too_long", str(e)) from None


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is http.disconnect: the client went away
    # (or the response was sent, by which time nobody waits on this any more).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _infer(
    request: Request, state: ServiceState, model: ModelService, token_ids: list[list[int]],
    options: Hashable = None, cost: int = 1,
) -> list:
    """Queue the texts and await their outputs; a client that disconnects meanwhile is dropped."""
    assert model.batcher is not None
    outputs = asyncio.ensure_future(
        model.batcher.submit(token_ids, timeout_s=state.settings.request_timeout_s, options=options, cost=cost)
    )
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({outputs, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not outputs.done():
            outputs.cancel()  # its queued texts are skipped when the next batch is formed
    if outputs not in done:
        raise ServiceError(CLIENT_CLOSED_REQUEST, "client_closed_request", "client closed the request")
    try:
        return outputs.result()
    except QueueFull as e:
        state.metrics.rejected.labels(request.url.path, "queue_full").inc()
        raise ServiceError(
            429, "overloaded", f"the {model.bundle.name} queue is full; {e}",
            headers={"Retry-After": str(e.retry_after_s)},
        ) from None
    except DeadlineExceeded:
        raise ServiceError(
            504, "deadline_exceeded",
            f"request not answered within {state.settings.request_timeout_s:g} s (LINFORMER_REQUEST_TIMEOUT_S); "
            "try again later",
        ) from None
    except ShuttingDown:
        raise ServiceError(503, "shutting_down", "the server is shutting down; retry on another replica") from None
    except BatchFailed:
        raise ServiceError(
            500, "inference_failed",
            f"the {model.bundle.name} model failed on the batch holding this request; the server is still "
            "serving, retrying may succeed (the error is in the server log under this request id)",
        ) from None


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


# ---- tasks ----


@router.post("/classify", response_model=ClassifyResponse, tags=["tasks"], responses=TASK_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, state: State):
    """Label each text (e.g. review sentiment); results come back in input order."""
    model = serving_model(state, "classify")
    texts = body.all_texts
    _check_text_count(texts, state.settings.max_texts_per_request)
    encoded = _tokenise(model, texts, body.truncate)
    logits = await _infer(request, state, model, [e.ids for e in encoded])
    labels = model.bundle.labels
    results = []
    for enc, row in zip(encoded, logits, strict=True):
        probs = _softmax(np.asarray(row, dtype=np.float64))
        best = int(probs.argmax())
        results.append(
            ClassifyResult(
                label=labels[best],
                score=float(probs[best]),
                scores={label: float(p) for label, p in zip(labels, probs, strict=True)},
                tokens=len(enc.ids),
                truncated=enc.truncated,
            )
        )
    return ClassifyResponse(model=model.bundle.name, results=results)


def _check_decode_budget(model: ModelService, texts: int, beam_size: int, max_new_tokens: int, limit: int) -> int:
    """Decode work per text (beam_size x max_new_tokens, as the runtime caps it); 413 if the request asks too much."""
    new_tokens = min(max_new_tokens, int(model.bundle.config.get("tgt_n_max", max_new_tokens)))
    per_text = beam_size * new_tokens
    if texts * per_text > limit:
        asked = max_new_tokens
        capped = f" (asked {asked}, capped at the model's target length)" if new_tokens < asked else ""
        raise ServiceError(
            413, "budget_exceeded",
            f"this request asks for {texts} texts x beam_size {beam_size} x max_new_tokens {new_tokens}{capped} = "
            f"{texts * per_text} decode tokens, over this server's limit of {limit} "
            "per request (LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST); send fewer texts, a smaller beam or a "
            "smaller max_new_tokens",
        )
    return per_text


@router.post("/translate", response_model=TranslateResponse, tags=["tasks"], responses=TASK_RESPONSES)
async def translate(body: TranslateRequest, request: Request, state: State):
    """Translate English to German (503 until a translation bundle and runtime are in place)."""
    model = serving_model(state, "translate")
    texts = body.all_texts
    _check_text_count(texts, state.settings.max_texts_per_request)
    cost = _check_decode_budget(
        model, len(texts), body.beam_size, body.max_new_tokens, state.settings.max_decode_tokens_per_request
    )
    encoded = _tokenise(model, texts, body.truncate)
    # the decoding runtime is batched per (beam_size, max_new_tokens): see Batcher's `options`
    outputs = await _infer(
        request, state, model, [e.ids for e in encoded], options=(body.beam_size, body.max_new_tokens), cost=cost
    )
    return TranslateResponse(
        model=model.bundle.name,
        translations=[{"text": model.tokenizer.decode(list(ids)), "tokens": len(ids)} for ids in outputs],
    )


# ---- operations ----


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict:
    """The process is alive (it may still have no model: see /readyz)."""
    return {"status": "ok"}


@router.get(
    "/readyz", response_model=Readiness, tags=["ops"],
    responses={503: {"model": Readiness, "description": "Not ready: a configured model did not load, no model "
                                                        "is configured, or the server is draining."}},
)  # fmt: skip
async def readyz(state: State):
    """Ready when every configured model is serving and the server is not draining."""
    serving = [m.bundle.name for m in state.models.values() if m.batcher is not None]
    not_loaded = list(state.failed.values())
    if state.draining:
        detail = "draining: finishing accepted requests before shutting down"
    elif not_loaded:
        detail = "; ".join(state.unavailable[task] for task in state.failed)
    elif not serving:
        detail = "; ".join(state.unavailable.values()) or "no model is loaded"
    else:
        return Readiness(ready=True, models=serving, detail="ok")
    body = Readiness(ready=False, models=serving, not_loaded=not_loaded, draining=state.draining, detail=detail)
    return JSONResponse(body.model_dump(), status_code=503)


@router.get("/v1/models", response_model=ModelsResponse, tags=["ops"])
async def list_models(state: State):
    """Bundles loaded by this server."""
    return ModelsResponse(
        models=[
            ModelInfo(
                name=m.bundle.name, task=m.bundle.task, attention=m.bundle.attention, n_max=m.bundle.n_max,
                k=m.bundle.k, labels=m.bundle.labels, execution_provider=m.execution_provider,
                serving=m.batcher is not None,
            )
            for m in state.models.values()
        ]
    )


@router.get("/metrics", tags=["ops"], include_in_schema=False)
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
