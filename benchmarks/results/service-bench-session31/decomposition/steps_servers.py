"""The service's /classify request steps (parse and validate the body, tokenise, the batcher and its compute thread,
the answer's JSON: `TaskEndpoint._validate` and `classify_answer` from service/routes.py) behind two minimal front
ends, for decompose.py (thirty-first session, issue #20):

    python steps_servers.py bare --port 8000      # the floor's bare asyncio protocol on uvloop, a task per request
    python steps_servers.py uvicorn --port 8000   # uvicorn (httptools, uvloop) with a minimal ASGI app

Neither has the service's middleware (request ids, admission, deadlines from arrival, access log, request metrics),
error answers, or its uvicorn protocol subclass; the disconnect watch is given a receive that never answers. LINFORMER_*
settings as the service reads them. GET /metrics: the service's metrics registry (the batcher's batch sizes)."""

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import uvloop
from prometheus_client import generate_latest

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

from benchmarks.peers.floor_classify import Connection  # noqa: E402
from service.app import load_models  # noqa: E402
from service.config import Settings  # noqa: E402
from service.deps import ServiceState  # noqa: E402
from service.metrics import Metrics  # noqa: E402
from service.routes import TaskEndpoint, classify_answer  # noqa: E402
from service.schemas import ClassifyRequest  # noqa: E402

state = ServiceState(settings=Settings(), metrics=Metrics())
endpoint = TaskEndpoint(state, ClassifyRequest, classify_answer)


def start() -> None:  # on the running loop: the batchers' tasks
    load_models(state)
    for model in state.models.values():
        if model.batcher is not None:
            model.batcher.start()
    gc.collect()
    gc.freeze()


async def never() -> dict:  # the disconnect watch's receive: the client never leaves
    return await asyncio.get_running_loop().create_future()


async def answer(body: bytes) -> bytes:
    scope = {"state": {"deadline": time.monotonic() + state.settings.request_timeout_s}}
    return await classify_answer(state, endpoint._validate(body), scope, never)


def response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (content_type, len(body), body)


class Steps:
    """The request steps behind the floor's bare protocol (benchmarks/peers/floor_classify.py `Connection`): one task
    per POST."""

    def submit(self, transport: asyncio.Transport, body: bytes) -> None:
        asyncio.get_running_loop().create_task(self.serve(transport, body))

    async def serve(self, transport: asyncio.Transport, body: bytes) -> None:
        out = await answer(body)
        if not transport.is_closing():
            transport.write(response(out))

    def metrics(self) -> bytes:
        return response(generate_latest(state.metrics.registry), b"text/plain")


async def asgi(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["method"] == "POST":
        out, content_type = await answer(b"".join(chunks)), b"application/json"
    else:
        out = generate_latest(state.metrics.registry) if scope["path"] == "/metrics" else b"ok"
        content_type = b"text/plain"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(out))]})  # fmt: skip
    await send({"type": "http.response.body", "body": out})


async def serve_bare(port: int) -> None:
    start()
    steps = Steps()
    server = await asyncio.get_running_loop().create_server(lambda: Connection(steps), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("front", choices=["bare", "uvicorn"])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    if args.front == "bare":
        uvloop.run(serve_bare(args.port))
    else:
        import uvicorn

        uvicorn.run(asgi, port=args.port, loop="uvloop", http="httptools", access_log=False, log_level="warning",
                    lifespan="on")  # fmt: skip


if __name__ == "__main__":
    main()
