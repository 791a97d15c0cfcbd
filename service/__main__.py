"""`python -m service [--host --port --models-dir]` (or `linformer-serve`): run the API under uvicorn.

SIGTERM starts a drain: /readyz answers 503 at once and every answer carries `Connection: close`, for
`drain_s` seconds, while the server keeps serving (a load balancer needs a moment to notice, and keep-alive
clients learn from the header to reconnect elsewhere rather than racing a closing socket). Then the server stops
accepting connections (`DrainingServer.stop_handshakes`; the listeners close once the loop has accepted what the
kernel had queued) and, for LAST_CALL_S more, still answers what the
connections it has send (each answer closes its connection), so that a client that connected just before is
answered rather than cut off. Then uvicorn closes the idle connections, lets accepted requests finish (at most
`request_timeout_s`, their deadline), the batchers finish their queues, and the process exits 0. A second
SIGTERM, or SIGINT, skips the drain.
"""

import argparse
import asyncio
import logging
import os
import resource
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.app import ServiceApp, create_app
from service.bundle import BundleError
from service.config import ROUTE_LIMIT_SETTINGS, Settings, settings_errors, unknown_variables, variable
from service.middleware import ADMISSION_SCOPE_KEY, MAX_HEAD_BYTES, Admission, RequestContextMiddleware

log = logging.getLogger("service")

# After the drain: how long connections already open may still send a request and be answered, once no new
# connection is accepted. uvicorn's shutdown closes a connection with no request in progress at once, also one
# opened a moment before whose request is still on its way: clients that reconnect after each drained answer
# lost requests that way (a read error, where a refused connection would have told them that nothing was sent;
# `benchmarks/drain.py --one-replica`, benchmarks/results/reliability-session16/).
LAST_CALL_S = 0.5

# Between the backlog's going to 0 and the listeners' closing, the loop accepts the connections the kernel had
# already completed; closing a listener resets whatever is still in its accept queue (and the requests clients
# sent on those). It closes once the queues are empty, or this long after the drain ended.
ACCEPT_QUEUE_WAIT_S = 1.0
TCP_INFO_BYTES, TCPI_UNACKED_OFFSET = 104, 24  # struct tcp_info: 8 one-byte fields, then u32 rto, ato, mss x2, unacked

# A keep-alive timer that fires this much after it was due was held up by a stalled process (stopped, or its core
# taken for seconds), not by an idle client: see AdmittingHttpToolsProtocol.timeout_keep_alive_handler.
KEEP_ALIVE_LATE_S = 1.0

# Files the process opens besides its connections: models, logs, the event loop's and the compute threads' own.
OTHER_FILES = 64

LOG_FORMAT = "time=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    parser.add_argument("--host", help="overrides LINFORMER_HOST")
    parser.add_argument("--port", type=int, help="overrides LINFORMER_PORT")
    parser.add_argument("--models-dir", type=Path, help="overrides LINFORMER_MODELS_DIR")
    parser.add_argument("--log-level", help="overrides LINFORMER_LOG_LEVEL")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as error:  # one line per bad setting, as for a refused bundle, and no traceback
        logging.basicConfig(format=LOG_FORMAT)
        for line in settings_errors(error, overrides):
            log.error("refusing to start: %s", line)
        sys.exit(2)
    serve(create_app(settings), settings)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains for `drain_s` before the usual graceful shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float):
        super().__init__(config)
        self.app, self.drain_s = app, drain_s
        self.drain_ends: float | None = None
        self.handshakes_stopped = False  # the drain has ended: the backlog is accepted, no new connection is
        self.last_call_ends: float | None = None  # a tick later the listeners close, and this is set

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_ends is None and self.drain_s > 0:
            self._captured_signals.append(sig)  # uvicorn re-raises it after shutting down: exit code below
            self.drain_ends = time.monotonic() + self.drain_s
            self.app.state.service.draining = True  # /readyz 503 and `Connection: close` from now on
            log.info("SIGTERM: draining for %g s (readyz 503, Connection: close), then shutting down", self.drain_s)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s
        now = time.monotonic()
        if self.drain_ends is not None and now >= self.drain_ends and not self.handshakes_stopped:
            self.stop_handshakes()
            self.handshakes_stopped = True
        elif self.handshakes_stopped and self.last_call_ends is None and (
            now >= self.drain_ends + ACCEPT_QUEUE_WAIT_S or not any(map(accept_queue_length, self.listening()))
        ):  # a tick later, once the loop has accepted what the kernel had queued
            for server in self.servers:  # uvicorn's shutdown closes them again, harmlessly
                server.close()
            self.last_call_ends = now + LAST_CALL_S
        if self.last_call_ends is not None and now >= self.last_call_ends:
            self.should_exit = True
        return await super().on_tick(counter)

    def stop_handshakes(self) -> None:
        """The listening sockets' backlog down to 0, so that the kernel stops completing new connections (their
        SYNs are dropped; the client's retry finds the socket closed and is refused) while the loop accepts those
        already queued. Closed at once instead, the socket would reset its queued connections, whose clients
        think them open and may have sent a request on them (requests still lost with the last call alone, in
        development runs of `benchmarks/drain.py --one-replica`)."""
        for listening in self.listening():
            with socket.socket(fileno=os.dup(listening.fileno())) as same:
                same.listen(0)

    def listening(self) -> list:
        """The listening sockets of every server uvicorn started (one per bound address)."""
        return [listening for server in self.servers for listening in server.sockets]


def accept_queue_length(listening: Any) -> int:
    """Connections the kernel has completed on a listening socket and the server not yet accepted (Linux: TCP_INFO's
    `tcpi_unacked` holds the accept queue's length on a listening socket); 0 where that cannot be read."""
    try:
        info = listening.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return 0
    return struct.unpack_from("I", info, TCPI_UNACKED_OFFSET)[0] if len(info) >= TCPI_UNACKED_OFFSET + 4 else 0


def _quiet_startup_refusal(app: FastAPI):
    """A refused bundle is already logged as one clear ERROR line; without this, uvicorn logs the traceback
    Starlette passes along with `lifespan.startup.failed` (25 lines that say nothing more)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def send_without_traceback(message: Message) -> None:
            # Starlette sends startup.failed from inside its `except`, so the exception being handled is ours
            if message["type"] == "lifespan.startup.failed" and isinstance(sys.exc_info()[1], BundleError):
                message = {**message, "message": ""}
            await send(message)

        await app(scope, receive, send_without_traceback)

    return wrapped


class _Refused:
    """Stands in for uvicorn's RequestResponseCycle of a request answered at admission: complete, so the parser
    callbacks that follow (body, end of message, connection lost) drop the body and wake nobody."""

    response_complete = True
    message_event = asyncio.Event()  # connection_lost sets it; nobody waits on it


_REFUSED = _Refused()


class _HeldRefusal:
    """Stands in for uvicorn's RequestResponseCycle of a refusal whose answer is held back (the refusals' rate
    limit, RequestContextMiddleware.refusal_delay): not complete, so uvicorn queues a request pipelined behind it
    and its graceful shutdown waits for it (clearing `keep_alive`); the refused request's body is dropped."""

    response_complete = False
    keep_alive = True  # (only keep-alive refusals are held; uvicorn's shutdown sets it False on the instance)
    message_event = asyncio.Event()  # uvicorn's parser callbacks set it; nobody waits on it
    body = property(lambda self: b"", lambda self, _body: None)  # (uvicorn appends the body it reads to it)


class _OneWriteResponses:
    """The connection's transport as uvicorn's protocol and its request cycles see it, but for one thing: uvicorn
    writes a response's head (status line and headers) and its body in two writes, each a system call and a TCP
    segment of its own, and on one core each costs the core the model runs on. A head that announces a
    content-length is held until the body's first bytes and goes out with them in one write (uvicorn writes the
    body in the same step of the same task, straight after the head), or when the response completes without one
    (HEAD) or its connection is closed. Everything else passes through: a 100 Continue, a chunked head, the
    answers written whole (refusals, 400s)."""

    __slots__ = ("transport", "head")

    def __init__(self, transport: asyncio.Transport):
        self.transport, self.head = transport, None

    def write(self, data: bytes) -> None:
        if self.head is not None:
            data, self.head = self.head + data, None
        elif data.endswith(b"\r\n\r\n") and b"\r\ncontent-length: " in data and data.startswith(b"HTTP/"):
            self.head = data
            return
        self.transport.write(data)

    def flush(self) -> None:
        if self.head is not None:
            self.transport.write(self.head)
            self.head = None

    def close(self) -> None:
        self.flush()  # (a response started and not finished: its head goes out, as it did)
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # the rest of asyncio.Transport (flow control, extra info, ...)
        return getattr(self.transport, name)


def _admitting_protocol(app: ServiceApp) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, except that a POST to a task route is admitted (its slot taken) or refused as
    soon as its headers are parsed, and a refusal answered there, before uvicorn builds the request's scope path,
    cycle, timers and ASGI task: under a flood most requests are refusals, and each one costs the core the model
    runs on. Written against uvicorn 0.54's callbacks (`pyproject.toml` pins the minor version;
    tests/test_service_reliability.py fails if the hook stops being called). Anything unusual (a pipelined
    request, an upgrade, a query string) takes uvicorn's path, where the ASGI middleware decides instead.
    It also bounds what uvicorn leaves unbounded before a request is read (a slowloris held a connection for ever by
    sending nothing or a byte at a time; header lines were kept without limit): a new connection has uvicorn's
    keep-alive timeout to start a request, and a request its deadline to finish its head (408) and MAX_HEAD_BYTES
    for it (431); and what uvicorn's parser cannot read gets the error shape."""

    class AdmittingHttpToolsProtocol(HttpToolsProtocol):
        # the bytes of a request's head that has begun and is not complete, counted from the reads that ended
        # inside it; None between heads. One attribute: uvicorn's protocol has 28, and past 29 an instance's
        # attributes no longer share their keys, 1.3 KB more for every connection
        head_bytes: int | None = None
        head_timer: asyncio.TimerHandle | None = None  # (only where a head spans reads)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.transport = _OneWriteResponses(transport)  # type: ignore[assignment]
            # uvicorn arms its keep-alive timeout only after an answer, so a connection that never sent a byte was
            # held for ever (each is an open file): it gets the same time as an idle keep-alive connection
            self._arm_keep_alive()

        def _arm_keep_alive(self) -> None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)  # fmt: skip

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn closes a connection idle for its keep-alive timeout (5 s). After a stall of the process longer
            than that, the loop runs its due timers before it reads the sockets, so a request a client sent on an
            idle keep-alive connection during the stall was still unread when the timer closed the connection, and
            was lost (the client saw a reset: a 7-s SIGSTOP lost it, a 2-s one did not). A timer firing late gives
            the reads a round first; a request among them cancels it, as any byte does (data_received)."""
            timer = self.timeout_keep_alive_task
            if timer is not None and self.loop.time() - timer.when() > KEEP_ALIVE_LATE_S:
                self.timeout_keep_alive_task = self.loop.call_later(KEEP_ALIVE_LATE_S, self.timeout_keep_alive_handler)
                return
            super().timeout_keep_alive_handler()

        def on_response_complete(self) -> None:
            self.transport.flush()  # a HEAD answer's head: uvicorn writes no body for it
            super().on_response_complete()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.head_bytes = 0

        def data_received(self, data: bytes) -> None:
            super().data_received(data)  # (uvicorn's first step: cancel the keep-alive timer)
            if self.transport.is_closing():
                return
            if self.head_bytes is not None:
                # a head that did not come whole (most come in one read, and need neither) must be complete within
                # the request timeout and MAX_HEAD_BYTES: uvicorn resets its keep-alive timer on every byte, so a
                # client trickling a header held its connection for ever, and keeps every header line it is sent,
                # so one connection sending lines made the process grow without bound (the body is bounded by the
                # request's deadline, TaskEndpoint, and by LINFORMER_MAX_BODY_BYTES)
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    self._end_head(lambda context: context.head_too_large(self.headers, self.client))
                elif self.head_timer is None:
                    self.head_timer = self.loop.call_later(app.state.service.settings.request_timeout_s,
                                                           self._head_timed_out)  # fmt: skip
            elif self.timeout_keep_alive_task is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_keep_alive()  # bytes that began no request (blank lines): as idle as before them

        def _head_timed_out(self) -> None:
            self.head_timer = None
            if self.head_bytes is not None and not self.transport.is_closing():
                self._end_head(lambda context: context.head_timed_out(self.headers, self.client))

        def _end_head(self, answer: Callable[[RequestContextMiddleware], bytes]) -> None:
            """Answer a request whose head is refused before it is complete, and close the connection."""
            if (context := app.request_context) is not None:  # (None: the middleware stack is not built yet)
                self.transport.write(answer(context))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self.head_bytes = None
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None
            context = app.request_context
            decision = None
            # (uvicorn's own limit_concurrency would hand the request to its 503 app instead of ours: not used)
            previous_done = self.cycle is None or self.cycle.response_complete  # else pipelined: uvicorn queues it
            if (context is not None and self.limit_concurrency is None and previous_done
                    and self.parser.get_method() == b"POST" and not self.parser.should_upgrade()):  # fmt: skip
                decision = context.arrive_at_headers(self.url)
            if decision is not Admission.REFUSE:
                super().on_headers_complete()
                if decision is not None:  # ADMIT (its slot taken) or WAIT: the middleware goes on from there
                    self.scope[ADMISSION_SCOPE_KEY] = decision
                return
            keep_alive = (self.parser.should_keep_alive() and self.parser.get_http_version() != "1.0"
                          and not app.state.service.draining)  # fmt: skip
            delay = context.refusal_delay() if keep_alive else 0.0
            if delay > 0:  # a client resending at once gets its next refusal no sooner: nothing read meanwhile
                self.cycle = held = _HeldRefusal()
                self.flow.pause_reading()
                self.loop.call_later(delay, self._answer_held, held, self.url, self.headers, self.client)
                return
            self.cycle = _REFUSED  # its body, if any, is read and dropped
            self.transport.write(context.refusal(self.url, self.headers, self.client))
            if keep_alive:
                self.on_response_complete()
            else:
                self.transport.close()

        def _answer_held(self, held: _HeldRefusal, *request: Any) -> None:
            """A held refusal's answer, as it would be now: the server stopping or draining meanwhile (uvicorn's
            shutdown clears `keep_alive`) closes the connection after it."""
            if self.transport.is_closing():  # the client left, or the server closed it
                return
            closing = not held.keep_alive or app.state.service.draining
            self.transport.write(app.request_context.refusal(*request, closing=closing))
            held.response_complete = True
            if closing:
                self.transport.close()
            else:
                self.on_response_complete()  # reads again (uvicorn's flow control), or starts a pipelined request

        def send_400_response(self, msg: str) -> None:
            """What the parser could not read gets the service's error shape, not uvicorn's text/plain line."""
            context = app.request_context
            if context is None:  # the middleware stack is not built yet (Starlette builds it on the lifespan call)
                super().send_400_response(msg)
                return
            self.transport.write(context.malformed(msg, self.headers or [], self.client))
            self.transport.close()

    return AdmittingHttpToolsProtocol


def configure_logging(settings: Settings, stream: TextIO | None = None) -> None:
    """key=value lines on stderr. The access log writes a line per request at the default level, and each record
    also looked up its caller's frame, thread and process, which the format never prints: 22-49 us of event-loop
    CPU per /classify request (benchmarks/request_loop.py). The logging HOWTO's "Optimization" switches skip that."""
    logging._srcfile = None  # no caller lookup: the format has no %(pathname)s, %(lineno)d or %(funcName)s
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT, stream=stream)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the process's soft limit on open files to its hard limit, as Go's runtime does for every program, and
    return (before, after). Each connection is a file, and a connection the server cannot accept is closed by
    libuv unanswered and unlogged: with the usual soft limit of 1,024 (most Linux logins; Docker's containers
    since its 25th release), a burst of 1,500 connections lost 492 requests that way, where the admission limits
    answer every one (a slot, the waiting room or 429)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and 0 <= soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a sandbox that forbids it: keep the soft limit (check_open_files warns)
            return soft, soft
        return soft, hard
    return soft, soft


def check_open_files(settings: Settings) -> None:
    """Log the raised limit, and warn if it is still below the connections the admission limits let in."""
    before, limit = raise_open_files_limit()
    if limit != before:
        log.info(f"open files limit (ulimit -n) raised from {before} to {limit}, the hard limit (a connection is one)")
    bursts = {task: settings.route_limits(task)[0] for task, model in settings.task_models.items() if model}
    admitted = sum(burst + settings.max_waiting_requests for burst in bursts.values())
    if limit != resource.RLIM_INFINITY and limit < admitted + OTHER_FILES:
        waiting = settings.max_waiting_requests
        per_route = " + ".join(f"/{task} {burst} in progress ({variable(ROUTE_LIMIT_SETTINGS[task][0])}) "
                               f"and {waiting} waiting" for task, burst in bursts.items())  # fmt: skip
        log.warning(
            f"this process may open {limit} files (ulimit -n), fewer than the {admitted} connections its admission "
            f"limits let in ({per_route}, {variable('max_waiting_requests')}) and {OTHER_FILES} of its own: "
            "connections over the limit are closed unanswered. Raise the hard limit (ulimit -Hn, systemd "
            "LimitNOFILE=, docker run --ulimit nofile=) or lower the waiting room"
        )


def serve(app: FastAPI, settings: Settings) -> None:
    configure_logging(settings)
    for warning in unknown_variables(os.environ):
        log.warning(warning)
    check_open_files(settings)
    # uvicorn drains on SIGTERM, then re-raises the signal; a completed graceful stop should exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(
        _quiet_startup_refusal(app),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # keep the key=value format set above
        access_log=False,  # service.access logs each request with its X-Request-ID
        lifespan="on",  # a bundle that fails verification stops the server
        http=_admitting_protocol(app) if isinstance(app, ServiceApp) else "auto",
        # after the drain: stop accepting, let accepted requests finish (bounded by their deadline), exit
        timeout_graceful_shutdown=settings.request_timeout_s + 5,
    )
    server = DrainingServer(config, app, settings.drain_s)
    try:
        server.run()
    except KeyboardInterrupt:
        sys.exit(130)
    if not server.started:
        sys.exit(3)  # start-up failed: exit as uvicorn.run would (Server.run only returns)


if __name__ == "__main__":
    main()
