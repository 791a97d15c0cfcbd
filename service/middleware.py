"""Per-request plumbing as plain ASGI: request id, admission control, body size limit, drain, access log, metrics.

Everything here runs before FastAPI reads or parses the body, so refusing a request (429 at capacity, 413
too large) costs a few microseconds instead of a JSON parse, validation and tokenisation: under a flood
the process keeps its CPU for the requests it accepted.
"""

import asyncio
import functools
import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import ROUTE_LIMIT_SETTINGS, variable
from service.deps import ServiceState
from service.errors import CLIENT_CLOSED_REQUEST, error_body

access_log = logging.getLogger("service.access")
log = logging.getLogger(__name__)

_REQUEST_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")
# routes whose requests reach a model: only these are admission-controlled
TASK_PATHS = ("/classify", "/translate")
_TASK_TARGETS = {path.encode(): path for path in TASK_PATHS}  # the request line's target, as the parser gives it
# where the header-parser callback leaves its admission decision for the ASGI middleware (service/__main__.py)
ADMISSION_SCOPE_KEY = "linformer.admission"
_REQUEST_ID_SLOT = "@request-id@"  # where a refusal's template takes the request id (JSON-safe, like every id)

# The most a request's head (request line and headers) may take: uvicorn has no bound and keeps every header line
# (nginx refuses beyond 32 KiB by default, Node.js 16 KiB; a JSON API's head is well under 1 KiB).
MAX_HEAD_BYTES = 64 * 1024

# The flood test (RouteAdmission). A window is flooded when requests arrived at more than FLOOD_RATIO times the rate
# they completed while the route was full (an arrival found no free slot), and calm when they arrived no faster than
# CALM_RATIO times that rate (or the route was never full). A stall of the core floods one window at most: the
# requests that piled up during it are read at once when the server runs again, and in the next window the usual
# arrivals meet a model working off a backlog at full speed (at 70 % load: 0.7 arrivals per completion, calm). A flood
# floods every window, so FLOOD_WINDOWS flooded windows with no calm one between start shedding, and it ends once
# SHED_CALM_S pass without a window that is not calm. Windows in between neither break a run of flooded ones nor keep
# a route shedding from being let off: completions come in batches (a /translate batch answers 16-32 requests at
# once), and in a 3x flood on /translate enough windows came out just under FLOOD_RATIO that, with a single such
# window breaking the run or ending shedding after SHED_CALM_S, shedding started late or stopped in mid-flood, the
# burst and the waiting room were let in, and accepted requests waited up to 1.5 s.
FLOOD_WINDOW_S = 0.1
FLOOD_RATIO = 2.0
CALM_RATIO = 1.0
FLOOD_WINDOWS = 2
SHED_CALM_S = 0.25


# Refusals answered at once beyond the rate limit (`max_refusals_per_s`), in seconds of it: a burst of refusals, a
# flood's first moment or a stall's pile, is answered at once; a sustained stream faster than the limit is held.
REFUSAL_BURST_S = 0.1
REFUSAL_TICK_S = 0.02  # held refusals are answered at multiples of this (monotonic clock), a tick's worth at a time


class Admission(Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REFUSE = "refuse"
    EXPIRED = "expired"  # waited until its deadline without a slot
    LEFT = "left"  # its client closed the connection while it waited


class RouteAdmission:
    """Admission control of one task route: how many requests it has in progress, and whether one more gets in.

    Up to `burst_limit` requests are in progress. One more waits for a free slot (up to `max_waiting` of them, first
    come first served, its body not yet read): a stall of the core piles up requests that are served soon after it,
    and they should wait, not be refused. Only when the route is full and its waiting room too is a request refused.
    While the route is flooded (the flood test above) it sheds: the waiting requests are refused and only
    `shed_limit` are in progress, about what keeps one core's model busy, so the requests it accepts keep their
    unloaded latency. When shedding begins, `on_shed(shed_limit)` is called: the middleware has the model's queue
    refuse what it holds beyond the `shed_limit` oldest requests (Batcher.shed), the rest of the burst let in while
    the flood was not yet recognised, which would otherwise be served late, after that backlog. Waiting requests are
    not given free slots while the current window so far looks flooded, nor after a flooded window until one shows
    calm, so that a flood's first requests are refused once it is recognised rather than served late.
    `clock` is time.monotonic; tests pass their own.
    """

    def __init__(self, burst_limit: int, shed_limit: int, max_waiting: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_shed: Callable[[int], object] | None = None):  # fmt: skip
        self.burst_limit, self.shed_limit, self.max_waiting = burst_limit, min(shed_limit, burst_limit), max_waiting
        self.clock = clock
        self.on_shed = on_shed
        self.in_flight = 0
        self.shedding = False
        self.waiting: deque[asyncio.Future[Admission]] = deque()  # ADMIT (in_flight counts it), REFUSE or EXPIRED
        self._window_end = -math.inf
        self._arrivals = self._completions = 0
        self.completed_per_s = 0.0  # in the last window that ended (refusal_delay's limit grows with it)
        self._found_full = False  # an arrival in this window found no free slot
        self._flooded_windows = 0  # in a row, up to the last one
        self._last_flooded_end = -math.inf
        self._recheck: asyncio.TimerHandle | None = None  # a held-back pile's look at the window's end

    @property
    def limit(self) -> int:
        return self.shed_limit if self.shedding else self.burst_limit

    def arrive(self) -> Admission:
        """Count an arrival and decide: ADMIT (counted in progress), WAIT (call `wait_for_slot`) or REFUSE."""
        self._roll()
        self._arrivals += 1
        if self.in_flight < self.limit and not self.waiting:  # waiting requests were first
            self.in_flight += 1
            return Admission.ADMIT
        self._found_full = True
        return Admission.REFUSE if self._no_room_to_wait() else Admission.WAIT

    def _no_room_to_wait(self) -> bool:
        """A request that finds the route full is refused: it sheds, or its waiting room is full."""
        return self.shedding or len(self.waiting) >= self.max_waiting

    async def wait_for_slot(self, timeout_s: float) -> Admission:
        """After WAIT: ADMIT once given a slot (counted in progress), REFUSE if the route starts shedding meanwhile,
        EXPIRED once `timeout_s` (the request's deadline) passes without a slot: it leaves the room then, rather than
        being admitted late. Cancelled (its client left): it leaves the room, and a slot given to it just before goes
        to the next waiting request."""
        loop = asyncio.get_running_loop()
        slot: asyncio.Future[Admission] = loop.create_future()
        self.waiting.append(slot)
        expiry = loop.call_later(timeout_s, self._expire, slot)
        try:
            return await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled() and slot.result() is Admission.ADMIT:
                self.complete(counted=False)  # admitted just before: give the slot back
            elif slot in self.waiting:  # (a cancelled slot may have been taken off the room already)
                self.waiting.remove(slot)
            raise
        finally:
            expiry.cancel()

    def _expire(self, slot: asyncio.Future[Admission]) -> None:
        if not slot.done():
            self.waiting.remove(slot)
            slot.set_result(Admission.EXPIRED)

    def complete(self, counted: bool = True) -> None:
        """A request in progress has its answer (or left): its slot goes to the first waiting request."""
        self.in_flight -= 1
        self._completions += counted
        self._roll()

    def _roll(self) -> None:
        now = self.clock()
        if now >= self._window_end:
            flooded = self._looks_flooded()
            if now >= self._window_end + FLOOD_WINDOW_S:  # nothing happened for a window or more: not a flood
                self._flooded_windows = 0
            elif flooded:
                self._flooded_windows += 1
            elif self._looks_calm():
                self._flooded_windows = 0
            if flooded:
                self._last_flooded_end = self._window_end
            if self._flooded_windows >= FLOOD_WINDOWS and not self.shedding:
                self.shedding = True
                while self.waiting:
                    slot = self.waiting.popleft()
                    if not slot.done():
                        slot.set_result(Admission.REFUSE)
                if self.on_shed is not None:  # the queue sheds too: admitted requests beyond the shed limit
                    self.on_shed(self.shed_limit)
            elif self.shedding and now - self._last_flooded_end >= SHED_CALM_S:
                self.shedding = False
            self.completed_per_s = self._completions / max(FLOOD_WINDOW_S, now - self._window_end + FLOOD_WINDOW_S)
            self._arrivals = self._completions = 0
            self._found_full = False
            self._window_end = now + FLOOD_WINDOW_S
        held = bool(self.waiting) and self._holds_waiting()
        while self.waiting and self.in_flight < self.limit and not held:
            slot = self.waiting.popleft()
            if not slot.done():
                self.in_flight += 1
                slot.set_result(Admission.ADMIT)
        if self.waiting and self.in_flight < self.limit and self._recheck is None:
            # held back with free slots: the next arrival or completion would look again, but a burst of one-off
            # requests may send none, so look again when this window ends
            self._recheck = asyncio.get_running_loop().call_later(max(0.0, self._window_end - now), self._look_again)

    def _look_again(self) -> None:
        self._recheck = None
        self._roll()

    def _looks_flooded(self) -> bool:
        """This window so far passes the flood test; while the route sheds, it is any window not calm."""
        if self.shedding:
            return not self._looks_calm()
        return self._full_and_arriving_faster_than(FLOOD_RATIO)

    def _looks_calm(self) -> bool:
        return not self._full_and_arriving_faster_than(CALM_RATIO)

    def _full_and_arriving_faster_than(self, ratio: float) -> bool:
        arrivals = self._arrivals
        return self._found_full and arrivals > self.shed_limit and arrivals > ratio * self._completions

    def _holds_waiting(self) -> bool:
        """Waiting requests are held back while this window looks flooded (a stall's pile is read within one window,
        after which arrivals fall below completions again), and after a flooded window until this one shows it calm
        with `shed_limit` completions (unless nothing is in progress that could complete). Released at the window's
        turn instead, a flood's waiting requests were served after 0.1-0.2 s in the room and behind the burst, which
        set the flood's p99 in some runs."""
        if self._looks_flooded():
            return True
        return bool(self._flooded_windows) and self.in_flight > 0 and (
            self._completions < self.shed_limit or not self._looks_calm())


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
        self.request_timeout_s = settings.request_timeout_s  # each request's deadline, from its arrival
        self.admission = {
            task: RouteAdmission(*settings.route_limits(task.removeprefix("/")), settings.max_waiting_requests,
                                 on_shed=functools.partial(self._shed_queue, task))
            for task in TASK_PATHS
        }  # fmt: skip
        # the 429's body for each route, full or shedding, split where the request id goes: formatted once, not per
        # refusal
        self._refusal_bodies = {
            (task, shedding): error_body("overloaded", self._at_capacity(task, shedding), _REQUEST_ID_SLOT).split(
                _REQUEST_ID_SLOT.encode())
            for task in TASK_PATHS for shedding in (False, True)
        }  # fmt: skip
        # moving average of a task request's time in the server: with `in_flight` requests ahead, Little's law
        # says the backlog clears in about that long, which is what Retry-After tells a refused client
        self._latency_s = dict.fromkeys(TASK_PATHS, 0.0)
        self._new_ids = _request_ids()
        self._min_refusals_per_s = settings.max_refusals_per_s  # 0: no limit
        self._refusals_per_completion = settings.refusals_per_completion
        self._next_refusal_at = -math.inf  # when the refusals' rate limit lets the next one be answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = self._request_id(scope["headers"])
        context = scope.setdefault("state", {})
        context["request_id"] = request_id  # error bodies quote it (request.state)
        # one deadline from arrival: waiting for a slot, queue and compute all count against it (routes.py)
        context["deadline"] = time.monotonic() + self.request_timeout_s
        status = 0
        path = scope["path"]
        task = path if path in self.admission and scope["method"] == "POST" else None
        endpoint = self.endpoints.get(path) if scope["method"] == "POST" else None
        # HEAD is GET without the body (RFC 9110 9.3.2; every server must support both): FastAPI routes GET only, so
        # the app sees a GET, and uvicorn, whose own scope still says HEAD, sends the head and leaves the body out
        app_scope = {**scope, "method": "GET"} if scope["method"] == "HEAD" else scope

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
        receive_body = receive  # after a wait in the room: what was read meanwhile first (`_wait_in_room`)

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive_body()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # chunked bodies have no content-length to check
                    raise HTTPException(413, self._too_large)
            return message

        admitted = False
        try:
            decision = Admission.ADMIT
            if task is not None:
                # decided already if the header-parser callback saw the request (served under uvicorn), else now
                decision = scope.get(ADMISSION_SCOPE_KEY) or self.admission[task].arrive()
                if decision is Admission.WAIT:
                    decision, receive_body = await self._wait_in_room(task, receive, context["deadline"])
                admitted = decision is Admission.ADMIT
                if admitted:  # the batcher runs a request at once that it knows to be the only one (routes._infer)
                    context["route_admission"] = self.admission[task]
            if decision is Admission.LEFT:  # nobody to answer: nothing read for the app, nothing computed
                status = CLIENT_CLOSED_REQUEST
                self.metrics.child(self.metrics.left_waiting, task, "client_left").inc()
            elif decision is Admission.EXPIRED:
                self.metrics.child(self.metrics.left_waiting, task, "deadline").inc()
                await self._send_error(send_with_context, 504, "deadline_exceeded", request_id,
                                       f"no slot within {self.request_timeout_s:g} s (LINFORMER_REQUEST_TIMEOUT_S): "
                                       f"{task} was at capacity for that long; try again later")  # fmt: skip
            elif decision is Admission.REFUSE:
                retry_after = self._refuse(task)
                await self._send_error(send_with_context, 429, "overloaded", request_id,
                                       self._at_capacity(task, self.admission[task].shedding),
                                       [(b"retry-after", str(retry_after).encode())])  # fmt: skip
            elif self._declared_length(scope) > self.max_body_bytes:
                await self._send_error(send_with_context, 413, "body_too_large", request_id, self._too_large)
            else:
                await (endpoint or self.app)(app_scope, receive_limited, send_with_context)
        except Exception:
            if status:
                raise  # the answer has started: nothing better to send; uvicorn closes the connection
            log.exception("request_id=%s unhandled error", request_id)
            await self._send_error(send_with_context, 500, "internal_error", request_id,
                                   "the server failed on this request; the request id is in its log")  # fmt: skip
        finally:
            elapsed = time.perf_counter() - started
            if admitted:
                self.admission[task].complete()
                if status == 200:
                    self._latency_s[task] = 0.9 * self._latency_s[task] + 0.1 * elapsed
            # a task request answered here (refused, expired, left) never reached the router: label it by its route
            routed = endpoint is not None or (task is not None and not admitted)
            route_label = path if routed else getattr(app_scope.get("route"), "path", "unmatched")
            self.metrics.observe_request(route_label, status, elapsed)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                "request_id=%s method=%s path=%s status=%d duration_ms=%.2f client=%s",
                request_id, scope["method"], path, status, elapsed * 1000, client[0],
            )

    async def _wait_in_room(self, task: str, receive: Receive, deadline: float) -> tuple[Admission, Receive]:
        """Wait for a slot on `task` while watching the connection: -> the outcome (ADMIT, REFUSE, EXPIRED or LEFT)
        and the `receive` the app reads the body from.

        A client that gives up (its timeout, a closed connection) leaves the room at once: otherwise its request would
        keep its place, be admitted later and computed for nobody, and everyone behind it would wait longer. ASGI says
        a client left only through `receive` (http.disconnect), so the body is read while waiting and kept for the app
        (uvicorn has it in memory already, up to its 64 KiB read-ahead); past LINFORMER_MAX_BODY_BYTES the watch stops
        and the app answers 413 once admitted."""
        room = self.admission[task]
        kept: deque[Message] = deque()
        waiting = asyncio.ensure_future(room.wait_for_slot(deadline - time.monotonic()))  # the request's one deadline
        watching = asyncio.ensure_future(self._read_until_client_leaves(receive, kept))
        try:
            await asyncio.wait((waiting, watching), return_when=asyncio.FIRST_COMPLETED)
            if watching.done() and watching.result():  # the client left
                if not waiting.done():
                    waiting.cancel()  # leaves the room (or gives back a slot it was given meanwhile)
                elif waiting.result() is Admission.ADMIT:
                    room.complete(counted=False)  # admitted in the same moment: the slot goes to the next one
                return Admission.LEFT, receive
            outcome = await waiting
        finally:
            watching.cancel()  # uvicorn's receive may be cancelled: what it has not returned stays buffered
            waiting.cancel()  # only if this task itself was cancelled: no-op once done

        async def kept_first() -> Message:
            return kept.popleft() if kept else await receive()

        return outcome, kept_first

    async def _read_until_client_leaves(self, receive: Receive, kept: deque[Message]) -> bool:
        """True once the client disconnects; False if it stopped watching over the body limit."""
        body_bytes = 0
        while body_bytes <= self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return True
            kept.append(message)
            body_bytes += len(message.get("body", b""))
        return False

    def arrive_at_headers(self, target: bytes) -> Admission | None:
        """Admission of a POST to `target` as soon as its headers are parsed: None if the target is no task route,
        else the decision, counted (ADMIT takes the slot now). uvicorn's protocol calls this (service/__main__.py)
        before it builds anything for the request, answers REFUSE with `refusal` and leaves ADMIT or WAIT in the
        scope under ADMISSION_SCOPE_KEY for `__call__`. Taking the slot here, not in the ASGI task, matters in a
        flood: the requests read in one turn of the event loop all have their headers parsed before any of their
        tasks runs, and with the slot taken in the task each of them saw the same free slot, got a task and all
        but one were refused there, at several times the cost (in a 3x flood 15 % of the refusals by a `perf trace`
        count, 10-40 % in `strace` samples; benchmarks/results/overload-waitroom/). Requests the callback does not see
        (in-process clients, targets with a query string, pipelined requests) are decided in `__call__`."""
        task = _TASK_TARGETS.get(target)
        return None if task is None else self.admission[task].arrive()

    def refusal(self, target: bytes, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None,
                closing: bool = False) -> bytes:  # fmt: skip
        """The whole HTTP/1.1 answer refusing a POST to `target` (a task route) that `arrive_at_headers` refused:
        a 429 under a flood skips uvicorn's request cycle, the ASGI task, the ASGI layers and the response
        machinery, since it is the one answer the server gives most often then. `closing`: the connection closes
        after it (as it does while the server drains)."""
        task = _TASK_TARGETS[target]
        request_id = self._request_id(headers)
        before_id, after_id = self._refusal_bodies[task, self.admission[task].shedding]
        body_length = len(before_id) + len(request_id) + len(after_id)
        close = b"connection: close\r\n" if closing or self.state.draining else b""
        self.metrics.child(self.metrics.requests, task, "429").inc()
        access_log.info("request_id=%s method=POST path=%s status=429 duration_ms=0.00 client=%s",
                        request_id, task, (client or ("-", 0))[0])  # fmt: skip
        encoded_id = request_id.encode()
        return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"retry-after: %d\r\nx-request-id: %s\r\n%s\r\n%s%s%s"
                % (body_length, self._refuse(task), encoded_id, close, before_id, encoded_id, after_id))  # fmt: skip

    def refusal_delay(self) -> float:
        """How long to hold a refusal at admission before answering it (0.0: answer it now). Refusals are answered
        at most `max_refusals_per_s` a second, or `refusals_per_completion` per request the routes completed a second
        in their last window if that is more, beyond a burst of REFUSAL_BURST_S' worth, the held ones in the order
        refused. Clients that resend the moment they are refused (ignoring Retry-After) otherwise get refusals as
        fast as the event loop can write them, and the model, fed by that loop, starves (Settings)."""
        if not self._min_refusals_per_s:
            return 0.0
        completed_per_s = sum(room.completed_per_s for room in self.admission.values())
        now = time.monotonic()
        at = max(now, self._next_refusal_at)
        self._next_refusal_at = at + 1 / max(self._min_refusals_per_s, self._refusals_per_completion * completed_per_s)
        if at - now <= REFUSAL_BURST_S:
            return 0.0
        self.metrics.held_refusals.inc()
        # answered on the next tick after its turn: the held refusals of a tick go out in one turn of the event loop,
        # which otherwise woke for each one, taking the core from the model thousands of times a second
        return math.ceil((at - REFUSAL_BURST_S) / REFUSAL_TICK_S) * REFUSAL_TICK_S - now

    def malformed(self, message: str, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None) -> bytes:
        """The whole HTTP/1.1 answer to a request uvicorn's parser could not read (`message` is uvicorn's reason),
        in the one error shape: uvicorn's own is a text/plain line without a request id. The connection closes, as
        uvicorn closes it: after a parse error nothing more on it can be read reliably."""
        return self._closing_answer(400, "bad_request", f"the request is not valid HTTP/1.1 ({message.rstrip('.')});"
                                    " nothing was processed", headers, client)  # fmt: skip

    def head_timed_out(self, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None) -> bytes:
        """The whole HTTP/1.1 answer to a request whose headers did not all arrive within the request timeout of
        their first byte (uvicorn has no such bound: a client trickling a header held its connection for ever)."""
        return self._closing_answer(408, "request_timeout", "the request's headers did not arrive within "
                                    f"{self.state.settings.request_timeout_s:g} s (LINFORMER_REQUEST_TIMEOUT_S) of "
                                    "their first byte; nothing was processed", headers, client)  # fmt: skip

    def head_too_large(self, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None) -> bytes:
        """The whole HTTP/1.1 answer to a request whose head grew past MAX_HEAD_BYTES before it was complete."""
        return self._closing_answer(431, "headers_too_large", f"the request's line and headers are over "
                                    f"{MAX_HEAD_BYTES} bytes; nothing was processed", headers, client)  # fmt: skip

    def _closing_answer(self, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]],
                        client: tuple[str, int] | None) -> bytes:  # fmt: skip
        """An answer in the error shape, logged and counted, after which the server closes the connection."""
        request_id = self._request_id(headers)
        body = error_body(code, message, request_id)
        self.metrics.observe_request("unmatched", status, 0.0)
        access_log.info("request_id=%s method=- path=- status=%d duration_ms=0.00 client=%s", request_id, status,
                        (client or ("-", 0))[0])  # fmt: skip
        return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n"
                b"connection: close\r\n\r\n%s" % (status, HTTPStatus(status).phrase.encode(), len(body),
                                                    request_id.encode(), body))  # fmt: skip

    def _shed_queue(self, task: str, keep_requests: int) -> None:
        """The route began shedding: its model's queue keeps its `keep_requests` oldest requests and refuses the rest
        (Batcher.shed), which the burst limit had let in during the flood's first windows."""
        model = self.state.models.get(task.removeprefix("/"))
        if model is not None and model.batcher is not None:
            refused = model.batcher.shed(keep_requests)
            log.info("%s began shedding a flood: its queue keeps at most its %d oldest requests, %d more refused", task,
                     keep_requests, refused)  # fmt: skip

    def _refuse(self, task: str) -> int:
        """Count a refusal at admission; -> Retry-After in seconds: the recent time a request of this task spends in
        the server, by which the requests in progress will be done (Little's law)."""
        self.metrics.child(self.metrics.rejected, task, "concurrency").inc()
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

    def _at_capacity(self, task: str, shedding: bool) -> str:
        admission = self.admission[task]
        burst, shed = map(variable, ROUTE_LIMIT_SETTINGS[task.removeprefix("/")])
        if shedding:
            return (f"{task} is shedding load ({admission.shed_limit} requests in progress while flooded, {shed}); "
                    "retry after the time in Retry-After")  # fmt: skip
        return (f"{task} is at capacity ({admission.burst_limit} requests in progress and {admission.max_waiting} "
                f"waiting, {burst} and {variable('max_waiting_requests')}); retry after the time in Retry-After")

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
