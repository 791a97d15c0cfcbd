"""Per-request plumbing as plain ASGI: request id, admission control, body size limit, drain, access log, metrics.

Everything here runs before FastAPI reads or parses the body, so refusing a request (429 at capacity, 413
too large) costs a few microseconds instead of a JSON parse, validation and tokenisation: under a flood
the process keeps its CPU for the requests it accepted.
"""

import itertools
import logging
import math
import os
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.deps import ServiceState
from service.errors import error_body

access_log = logging.getLogger("service.access")
log = logging.getLogger(__name__)

_REQUEST_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")
# routes whose requests reach a model: only these are admission-controlled
TASK_PATHS = ("/classify", "/translate")
_TASK_TARGETS = {path.encode(): path for path in TASK_PATHS}  # the request line's target, as the parser gives it
_REQUEST_ID_SLOT = "@request-id@"  # where a refusal's template takes the request id (JSON-safe, like every id)
# A route sheds (admits only `shed_concurrent_requests`) while it is flooded: while, in the current window of this
# many seconds or the last one, it refused more than one request for every two it completed. Arrivals are then
# over 1.5x what it serves, which a stall short enough for the burst limit to absorb cannot produce (refusals
# start only once the burst limit is full, and every request in it completes soon after the stall).
SHED_WINDOW_S = 0.25


def _valid_request_id(given: bytes) -> bool:  # echoed only if harmless in a header and a log
    return 0 < len(given) <= 128 and all(byte in _REQUEST_ID_CHARS for byte in given)


def _request_ids():
    """32 hex characters, unique per process start and request: a random prefix and a counter. uuid4 reads
    the OS's randomness for every request, a syscall that showed as 4 % of the server's time under a flood."""
    prefix = os.urandom(8).hex()
    return (f"{prefix}{n:016x}" for n in itertools.count())


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, *, state: ServiceState, endpoints: dict[str, ASGIApp] | None = None):
        """`endpoints`: path -> plain ASGI app that answers POST requests to it instead of `app` (the framework)."""
        self.app = app
        self.endpoints = endpoints or {}
        self.state = state
        self.metrics = state.metrics
        settings = state.settings
        self.max_body_bytes = settings.max_body_bytes
        self.burst_limit = settings.max_concurrent_requests
        self.shed_limit = min(settings.shed_concurrent_requests, settings.max_concurrent_requests)
        self.in_flight = dict.fromkeys(TASK_PATHS, 0)
        # per route: shedding or not, and the current window's end (time.monotonic()), refusals and completions
        self._shedding = dict.fromkeys(TASK_PATHS, False)
        self._window_ends = dict.fromkeys(TASK_PATHS, 0.0)
        self._refused = dict.fromkeys(TASK_PATHS, 0)
        self._completed = dict.fromkeys(TASK_PATHS, 0)
        # the 429's body for each route and limit, split where the request id goes: formatted once, not per refusal
        self._refusal_bodies = {
            (task, limit): error_body("overloaded", self._at_capacity(task, limit), _REQUEST_ID_SLOT).split(
                _REQUEST_ID_SLOT.encode())
            for task in TASK_PATHS for limit in (self.burst_limit, self.shed_limit)
        }  # fmt: skip
        # moving average of a task request's time in the server: with `in_flight` requests ahead, Little's law
        # says the backlog clears in about that long, which is what Retry-After tells a refused client
        self._latency_s = dict.fromkeys(TASK_PATHS, 0.0)
        self._new_ids = _request_ids()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = self._request_id(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id  # error bodies quote it (request.state)
        status = 0
        path = scope["path"]
        task = path if path in self.in_flight and scope["method"] == "POST" else None
        endpoint = self.endpoints.get(path) if scope["method"] == "POST" else None

        async def send_with_context(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                if self.state.draining:  # rolling restart: finish this answer, then move to another replica
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
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

        admitted = False
        try:
            if task is not None and self.in_flight[task] >= (limit := self._limit(task)):
                retry_after = self._refuse(task)
                await self._send_error(send_with_context, 429, "overloaded", request_id, self._at_capacity(task, limit),
                                       [(b"retry-after", str(retry_after).encode())])  # fmt: skip
            elif self._declared_length(scope) > self.max_body_bytes:
                await self._send_error(send_with_context, 413, "body_too_large", request_id, self._too_large)
            else:
                if task is not None:
                    self.in_flight[task] += 1
                    admitted = True
                await (endpoint or self.app)(scope, receive_limited, send_with_context)
        except Exception:
            if status:
                raise  # the answer has started: nothing better to send; uvicorn closes the connection
            log.exception("request_id=%s unhandled error", request_id)
            await self._send_error(send_with_context, 500, "internal_error", request_id,
                                   "the server failed on this request; the request id is in its log")  # fmt: skip
        finally:
            elapsed = time.perf_counter() - started
            if admitted:
                self.in_flight[task] -= 1
                self._completed[task] += 1
                if status == 200:
                    self._latency_s[task] = 0.9 * self._latency_s[task] + 0.1 * elapsed
            route_label = path if endpoint is not None else getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe_request(route_label, status, elapsed)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                "request_id=%s method=%s path=%s status=%d duration_ms=%.2f client=%s",
                request_id, scope["method"], path, status, elapsed * 1000, client[0],
            )

    def refusal(self, target: bytes, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None
                ) -> bytes | None:  # fmt: skip
        """The whole HTTP/1.1 answer refusing a POST to `target` at admission, or None to let it in.

        uvicorn's protocol calls this as soon as a POST's headers are parsed (service/__main__.py), before it builds
        anything for the request, so a 429 under a flood skips uvicorn's request cycle, the ASGI task, the ASGI
        layers and the response machinery: it is the one answer the server gives most often then. The ASGI path
        above checks the same limit again (in-process clients, targets with a query string, pipelined requests).
        """
        task = _TASK_TARGETS.get(target)
        if task is None or self.in_flight[task] < (limit := self._limit(task)):
            return None
        request_id = self._request_id(headers)
        before_id, after_id = self._refusal_bodies[task, limit]
        body_length = len(before_id) + len(request_id) + len(after_id)
        close = b"connection: close\r\n" if self.state.draining else b""
        self.metrics.child(self.metrics.requests, task, "429").inc()
        access_log.info("request_id=%s method=POST path=%s status=429 duration_ms=0.00 client=%s",
                        request_id, task, (client or ("-", 0))[0])  # fmt: skip
        encoded_id = request_id.encode()
        return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"retry-after: %d\r\nx-request-id: %s\r\n%s\r\n%s%s%s"
                % (body_length, self._refuse(task), encoded_id, close, before_id, encoded_id, after_id))  # fmt: skip

    def _limit(self, task: str) -> int:
        """The in-progress limit of this route now: the burst limit, or the shedding one while it is flooded."""
        now = time.monotonic()
        if now >= self._window_ends[task]:  # a new window: it sheds if the last one was a flood
            self._shedding[task] = self._flooded(task)
            self._refused[task] = self._completed[task] = 0
            self._window_ends[task] = now + SHED_WINDOW_S
        return self.shed_limit if self._shedding[task] else self.burst_limit

    def _flooded(self, task: str) -> bool:
        return self._refused[task] > max(self.shed_limit, self._completed[task] / 2)

    def _refuse(self, task: str) -> int:
        """Count a refusal at admission (and start shedding at once when it makes a flood: waiting for the window's
        end would let the flood fill the burst limit for that long); -> Retry-After in seconds: the recent time a
        request of this task spends in the server, by which the requests in progress will be done (Little's law)."""
        self.metrics.child(self.metrics.rejected, task, "concurrency").inc()
        self._refused[task] += 1
        if not self._shedding[task] and self._flooded(task):
            self._shedding[task] = True
        return max(1, math.ceil(self._latency_s[task]))

    def _request_id(self, headers: list[tuple[bytes, bytes]]) -> str:
        given_id = next((value for name, value in headers if name == b"x-request-id"), b"")
        return given_id.decode("ascii") if _valid_request_id(given_id) else next(self._new_ids)

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    @property
    def _too_large(self) -> str:
        return f"request body is over the limit of {self.max_body_bytes} bytes (LINFORMER_MAX_BODY_BYTES)"

    def _at_capacity(self, task: str, limit: int) -> str:
        setting = "LINFORMER_MAX_CONCURRENT_REQUESTS" if limit == self.burst_limit else (
            "LINFORMER_SHED_CONCURRENT_REQUESTS while it sheds load")
        return f"{task} is at capacity ({limit} requests in progress, {setting}); retry after the time in Retry-After"

    @staticmethod
    async def _send_error(
        send: Send, status: int, code: str, request_id: str, message: str,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        body = error_body(code, message, request_id)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *(extra_headers or [])]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
