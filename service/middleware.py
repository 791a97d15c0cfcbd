"""Per-request plumbing as plain ASGI: request id, body size limit, access log, request metrics."""

import json
import logging
import re
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.metrics import Metrics

access_log = logging.getLogger("service.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # echoed only if harmless in a header and a log


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: Metrics, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        given_id = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given_id if _REQUEST_ID.match(given_id) else uuid.uuid4().hex
        status = 500  # if the app raises before answering, ServerErrorMiddleware sends a 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # chunked bodies have no content-length to check
                    raise HTTPException(413, self._too_large)
            return message

        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        try:
            if declared > self.max_body_bytes:
                await self._send_413(send_with_id)
            else:
                await self.app(scope, receive_limited, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            route_label = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(route_label, str(status)).inc()
            self.metrics.latency.labels(route_label).observe(elapsed)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                "request_id=%s method=%s path=%s status=%d duration_ms=%.2f client=%s",
                request_id, scope["method"], scope["path"], status, elapsed * 1000, client[0],
            )

    @property
    def _too_large(self) -> str:
        return f"request body is over the limit of {self.max_body_bytes} bytes"

    async def _send_413(self, send: Send) -> None:
        body = json.dumps({"detail": self._too_large}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
