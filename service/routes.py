"""HTTP routes: validate -> tokenise -> batcher -> decode -> response. No policy lives here."""

import asyncio
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from service.batcher import BatchFailed, DeadlineExceeded, QueueFull, Shed, ShuttingDown
from service.deps import ModelService, ServiceState, State, serving_model
from service.errors import (
    CLIENT_CLOSED_REQUEST,
    ServiceError,
    documented,
    error_body,
    invalid_request_body,
    unparseable_body_message,
)
from service.runtime import new_tokens_limit
from service.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    ModelInfo,
    ModelsResponse,
    Readiness,
    TaskRequest,
    TranslateRequest,
    TranslateResponse,
)
from service.tokenizer import Encoded, TextTooLong, TooManySentences

router = APIRouter()

TASK_RESPONSES = documented(400, 408, 413, 422, 429, 431, 499, 500, 503, 504)


# ---- shared steps ----


def _check_text_count(texts: list[str], limit: int) -> None:
    if len(texts) > limit:
        raise RequestValidationError(
            [{"type": "too_long", "loc": ("body", "texts"), "input": len(texts),
              "msg": f"at most {limit} texts per request, got {len(texts)}"}]
        )


def _tokenise(model: ModelService, texts: list[str], truncate: bool):
    try:
        return model.tokenizer.encode_to_classify(texts, truncate=truncate)
    except TextTooLong as e:
        raise ServiceError(413, "text_too_long", str(e)) from None


class _DisconnectWatch:
    """Calls `on_disconnect` once when `receive` answers http.disconnect (or fails), until `close()`.

    The body is already read, so the next ASGI message is http.disconnect: the client went away (or the response
    was sent, by which time the watch is closed). This drives the `receive()` coroutine itself, as a Task would:
    each step runs it to its next await and resumes it from the awaited future's done callback. A Task per request
    for this (created, first step, cancelled, its unwinding step and its done callback) cost ~15-25 µs of event-loop
    CPU per request, about a fifth of the loop's whole work for a short text; this costs one step and a callback."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]):
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._coroutine: Coroutine | None = None
        self._awaited: asyncio.Future | None = None
        self.fired = self._closed = False
        self._step()

    def _step(self, _awaited: object = None) -> None:
        self._awaited = None
        if self._closed:  # a step scheduled before close()
            return
        if self._coroutine is None:
            self._coroutine = self._receive()
        try:
            awaited = self._coroutine.send(None)
        except StopIteration as end:
            self._coroutine = None
            if end.value["type"] == "http.disconnect":
                self._fire()
            else:  # more body than announced, or a server that sends something else: keep listening
                asyncio.get_running_loop().call_soon(self._step)
            return
        except asyncio.CancelledError:  # the server cancelled the receive: not a disconnect
            self._coroutine = None
            return
        except Exception:  # a failing receive ends the request as the client's going away does
            self._coroutine = None
            self._fire()
            return
        if awaited is None:  # a bare yield (asyncio.sleep(0)): run again on the next loop pass
            asyncio.get_running_loop().call_soon(self._step)
        else:  # an asyncio future: resume when it is done, as a Task does
            awaited._asyncio_future_blocking = False
            self._awaited = awaited
            awaited.add_done_callback(self._step)

    def _fire(self) -> None:
        self.fired = True
        self._on_disconnect()

    def close(self) -> None:
        """Stop watching: the awaited future forgets the callback and the receive coroutine is closed."""
        self._closed = True
        if self._awaited is not None:
            self._awaited.remove_done_callback(self._step)
            self._awaited = None
        if self._coroutine is not None:
            self._coroutine.close()
            self._coroutine = None


def _time_left_s(scope: Scope, state: ServiceState) -> float:
    """What is left of the request's deadline: RequestContextMiddleware sets it on arrival, so the time a request
    waited for an admission slot counts against it (a bare app without the middleware starts it now)."""
    deadline = scope.get("state", {}).get("deadline")
    return state.settings.request_timeout_s if deadline is None else deadline - time.monotonic()


async def _infer(
    scope: Scope, receive: Receive, state: ServiceState, model: ModelService, route: str, token_ids: list[list[int]],
    options: Hashable = None, cost: int | list[int] = 1,
) -> list:
    """Queue the texts and await their outputs; a client that disconnects meanwhile is dropped: the watch cancels
    this task, and the batcher skips the texts of a cancelled request before compute."""
    assert model.batcher is not None
    request_task = asyncio.current_task()
    assert request_task is not None
    admission = scope.get("state", {}).get("route_admission")  # (RequestContextMiddleware's, once admitted)
    alone = admission is not None and admission.in_flight == 1  # no other request on this route in progress
    watch = _DisconnectWatch(receive, request_task.cancel)
    try:
        return await model.batcher.submit(token_ids, timeout_s=_time_left_s(scope, state), options=options,
                                          cost=cost, alone=alone)  # fmt: skip
    except asyncio.CancelledError:
        if not watch.fired:
            raise  # cancelled from outside (shutdown): not ours to answer
        if hasattr(request_task, "uncancel"):  # Python 3.11+: the cancellation is answered here, not propagated
            request_task.uncancel()
        raise ServiceError(CLIENT_CLOSED_REQUEST, "client_closed_request", "client closed the request") from None
    except QueueFull as e:
        shed = isinstance(e, Shed)
        state.metrics.rejected.labels(route, "shed" if shed else "queue_full").inc()
        message = (f"{route} began shedding a flood and this request was queued behind the ones it keeps (nothing was "
                   "computed); retry after the time in Retry-After" if shed else
                   f"the {model.bundle.name} queue is full; {e}")  # fmt: skip
        raise ServiceError(429, "overloaded", message, headers={"Retry-After": str(e.retry_after_s)}) from None
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
    finally:
        watch.close()


# ---- tasks ----


@functools.cache
def _json_string(text: str) -> str:
    return json.dumps(text)


def classification_json(probabilities: list[list[float]], labels: list[str]) -> list[str]:
    """One batch's rows -> each row's ClassifyResult as JSON without its last two fields (tokens, truncated: the
    route knows those), exactly as `json.dumps` writes it. Run once per batch in the compute thread: per request
    in the event loop, `json.dumps` of a small dict cost more than the whole batch's formatting here."""
    names = [json.dumps(label) for label in labels]
    rows = []
    for row in probabilities:
        best = max(range(len(row)), key=row.__getitem__)
        if not all(map(math.isfinite, row)):  # NaN from a broken model: json's spelling of it, not repr's
            rows.append(json.dumps({"label": labels[best], "score": row[best],
                                    "scores": dict(zip(labels, row, strict=True))})[1:-1])  # fmt: skip
            continue
        scores = ", ".join([f"{name}: {p!r}" for name, p in zip(names, row, strict=True)])
        rows.append(f'"label": {names[best]}, "score": {row[best]!r}, "scores": {{{scores}}}')
    return rows


async def classify_answer(state: ServiceState, body: ClassifyRequest, scope: Scope, receive: Receive) -> bytes:
    """A validated /classify request -> the JSON of its ClassifyResponse, built as plain data (the response
    model would only validate again what the server itself just computed) from the rows the batch formatted."""
    model = serving_model(state, "classify")
    texts = body.all_texts
    _check_text_count(texts, state.settings.max_texts_per_request)
    encoded = _tokenise(model, texts, body.truncate)
    rows = await _infer(scope, receive, state, model, "/classify", [e.ids for e in encoded])
    results = ", ".join([f'{{{row}, "tokens": {len(enc.ids)}, "truncated": {"true" if enc.truncated else "false"}}}'
                         for enc, row in zip(encoded, rows, strict=True)])  # fmt: skip
    return f'{{"model": {_json_string(model.bundle.name)}, "results": [{results}]}}'.encode()


@router.post("/classify", response_model=ClassifyResponse, tags=["tasks"], responses=TASK_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, state: State):
    """Label each text (e.g. review sentiment); results come back in input order."""
    # In the server, RequestContextMiddleware hands POST /classify and /translate to their TaskEndpoint below,
    # which takes the same steps without the framework's layers; these routes document the API and serve a bare
    # FastAPI app.
    return Response(await classify_answer(state, body, request.scope, request.receive), media_type="application/json")


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or (media_type.startswith(b"application/") and
                                                 media_type.endswith(b"+json"))  # fmt: skip


class TaskEndpoint:
    """POST /classify or /translate as plain ASGI: it skips what FastAPI adds per request (five middleware layers,
    routing, dependency solving, validating the response it is handed): for /translate 0.35-0.6 ms of event-loop
    CPU per request on the 2-core VM (1.4-1.8 -> 1.1-1.2 ms, a 16-token sentence taking ~11 ms), which a single
    stream waits for. The body is validated once, and every answer has the status codes and the error shape of the
    FastAPI routes.
    `answer(state, body, scope, receive)` -> the response JSON of a validated body."""

    def __init__(self, state: ServiceState, request_model: type[TaskRequest],
                 answer: Callable[[ServiceState, Any, Scope, Receive], Awaitable[bytes]]):  # fmt: skip
        self.state, self.request_model, self.answer = state, request_model, answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = scope["state"]["request_id"]
        headers: list[tuple[bytes, bytes]] = []
        try:
            body = await self._read_body(scope, receive, _time_left_s(scope, self.state))
            status, answer = 200, await self.answer(self.state, self._validate(body), scope, receive)
        except ServiceError as e:
            status, answer = e.status, error_body(e.code, e.message, request_id)
            headers = [(name.lower().encode(), value.encode()) for name, value in e.headers.items()]
        except RequestValidationError as e:
            status, answer = 422, invalid_request_body(e.errors(), request_id)
        except HTTPException as e:  # the body limit, raised by the middleware's receive
            status, answer = e.status_code, error_body("body_too_large", str(e.detail), request_id)
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    async def _read_body(self, scope: Scope, receive: Receive, time_left_s: float) -> bytes:
        """The body, within what is left of the request's deadline: a client that sends its headers and then
        stalls or trickles would otherwise hold its admission slot for as long as it keeps the connection (a
        hundred such connections, the burst limit, and every other request waited in the room until its 504)."""
        chunks = []
        task = asyncio.current_task()
        assert task is not None
        expired = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = asyncio.get_running_loop().call_later(max(0.0, time_left_s), expire)
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ServiceError(CLIENT_CLOSED_REQUEST, "client_closed_request", "client closed the request")
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except asyncio.CancelledError:
            if not expired:
                raise  # cancelled from outside (shutdown), not by the deadline
            if hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is answered here, not propagated
                task.uncancel()
            raise ServiceError(408, "request_timeout",
                               f"the request body did not arrive within {self.state.settings.request_timeout_s:g} s "
                               "(LINFORMER_REQUEST_TIMEOUT_S) of the request's arrival",
                               headers={"Connection": "close"}) from None  # fmt: skip
        finally:
            timer.cancel()
        content_type = encoding = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"content-encoding":
                encoding = value
        if content_type is not None and not _is_json(content_type):  # as FastAPI: only JSON bodies are parsed
            raise RequestValidationError([{"type": "json_type", "loc": ("body",),
                                           "msg": "the request body must be JSON (Content-Type: application/json)"}])
        if encoding is not None and encoding.strip().lower() != b"identity":  # (it was read as "not valid UTF-8")
            raise RequestValidationError([{"type": "content_encoding", "loc": ("body",),
                                           "msg": f"Content-Encoding {encoding.decode('latin-1')!r} is not "
                                                  "supported: send the body uncompressed"}])  # fmt: skip
        return b"".join(chunks)

    def _validate(self, body: bytes) -> TaskRequest:
        # json.loads, then the model: pydantic's own JSON parser refuses NaN and lone surrogates outright, where
        # this way each problem is listed where it is, exactly as FastAPI's routes answer
        if not body:
            raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                           "msg": f"JSON decode error: {e.msg}"}]) from None  # fmt: skip
        except (ValueError, RecursionError) as e:  # not UTF-8, nested too deeply, an integer too long
            raise ServiceError(422, "invalid_request", unparseable_body_message(e)) from None
        try:
            return self.request_model.model_validate(data)
        except ValidationError as e:
            errors = e.errors(include_url=False, include_input=False, include_context=False)
            raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in errors]) from None


def _over_budget(rows: str, tokens: str, beam_size: int, max_new_tokens: int, tgt_n_max: int, limit: int,
                 fewer: str) -> ServiceError:  # fmt: skip
    """413 for a /translate request whose `rows` ("2 sentences") x beam_size may generate `tokens` ("72") decode
    tokens, over `limit`; `fewer` names what to send fewer of."""
    return ServiceError(
        413, "budget_exceeded",
        f"this request's {rows} x beam_size {beam_size} may generate {tokens} decode tokens (max_new_tokens "
        f"{max_new_tokens} each, at most the model's target length {tgt_n_max} and twice the source + 16), over this "
        f"server's limit of {limit} per request (LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST); send fewer {fewer}, a "
        "smaller beam or a smaller max_new_tokens",
    )


def _decode_costs(tgt_n_max: int, rows: str, encoded: list[Encoded], beam_size: int, max_new_tokens: int,
                  limit: int) -> list[int]:  # fmt: skip
    """Decode work per row, a sentence or a text: beam_size x the tokens it may generate (max_new_tokens, capped as
    the runtime caps it: the model's target length `tgt_n_max`, twice the source + 16); 413 if the request asks too
    much. `rows` names what the rows are ("sentences", "texts")."""
    costs = [beam_size * new_tokens_limit(len(e.ids), max_new_tokens, tgt_n_max) for e in encoded]
    if sum(costs) > limit:
        raise _over_budget(f"{len(costs)} {rows}", str(sum(costs)), beam_size, max_new_tokens, tgt_n_max, limit,
                           fewer="texts")  # fmt: skip
    return costs


async def translate_answer(state: ServiceState, body: TranslateRequest, scope: Scope, receive: Receive) -> bytes:
    """A validated /translate request -> the JSON of its TranslateResponse, built as plain data."""
    model = serving_model(state, "translate")
    texts = body.all_texts
    _check_text_count(texts, state.settings.max_texts_per_request)
    # each text's sentences (with the whitespace after each, what the vocabulary lacks as placeholders), one row each,
    # no more than the decode budget can pay for at the least a row costs (as if it had no token)
    tgt_n_max = int(model.bundle.config.get("tgt_n_max", body.max_new_tokens))
    least_per_row = body.beam_size * new_tokens_limit(0, body.max_new_tokens, tgt_n_max)
    limit = state.settings.max_decode_tokens_per_request
    rows = "sentences" if body.split_sentences else "texts"
    try:
        sources = model.tokenizer.translation_sources(texts, split=body.split_sentences, truncate=body.truncate,
                                                      max_rows=limit // least_per_row)  # fmt: skip
    except TextTooLong as e:
        raise ServiceError(413, "text_too_long", str(e)) from None
    except TooManySentences as e:  # (counted no further than this: a row over what the budget can pay for)
        raise _over_budget(f"{e.limit + 1} or more {rows}", f"at least {(e.limit + 1) * least_per_row}",
                           body.beam_size, body.max_new_tokens, tgt_n_max, limit, fewer=rows) from None  # fmt: skip
    encoded = [source.encoded for source in sources]
    costs = _decode_costs(tgt_n_max, rows, encoded, body.beam_size, body.max_new_tokens, limit)
    # the decoding runtime is batched per (beam_size, max_new_tokens): see Batcher's `options`
    outputs = await _infer(scope, receive, state, model, "/translate", [e.ids for e in encoded],
                           options=(body.beam_size, body.max_new_tokens), cost=costs)  # fmt: skip
    translations = model.tokenizer.translations(sources, outputs)
    return json.dumps({"model": model.bundle.name, "translations": translations}, ensure_ascii=False).encode()


@router.post("/translate", response_model=TranslateResponse, tags=["tasks"], responses=TASK_RESPONSES)
async def translate(body: TranslateRequest, request: Request, state: State):
    """Translate English to German (503 until a translation bundle and runtime are in place)."""
    return Response(await translate_answer(state, body, request.scope, request.receive),
                    media_type="application/json")  # fmt: skip


# ---- operations ----


@router.get("/", tags=["ops"], include_in_schema=False)
async def index() -> dict:
    """The bare address (where a browser goes first): what this server answers and where the API is described."""
    paths = sorted({route.path for route in router.routes if getattr(route, "include_in_schema", False)})
    return {"service": "linformer-serve", "docs": "/docs", "openapi": "/openapi.json", "routes": paths}


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
