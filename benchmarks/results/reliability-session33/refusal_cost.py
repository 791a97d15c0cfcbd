"""The event loop's Python work per refusal, in-process (thirty-third session, issue #12): the service's admitting
protocol (service/__main__.py) on uvloop with a stand-in transport, its /classify route made to shed (full, shedding,
no rate limit on refusals), fed the overload benchmark's request 20,000 times after 2,000 to warm up; prints the
microseconds per refusal. No sockets, so no kernel time: a lower bound on what each refusal of a flood costs the core.

`--without timer,scope,metrics` (development knock-outs, each a patch of uvicorn's protocol or the metrics, not a
server one could ship): `timer` arms and cancels no keep-alive timer, `scope` builds no ASGI scope at the request's
first byte, `metrics` counts nothing.

    taskset -c 0 python benchmarks/results/reliability-session33/refusal_cost.py [--without timer]
"""

import argparse
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import uvicorn  # noqa: E402
import uvloop  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from benchmarks.loadgen import one_text_request  # noqa: E402
from service.__main__ import _admitting_protocol  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402


class Transport:
    """Counts the 429s written; never closes unless asked."""

    def __init__(self):
        self.refusals, self.closing = 0, False

    def write(self, data: bytes) -> None:
        self.refusals += data.startswith(b"HTTP/1.1 429 ")

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def knock_out(parts: set[str]) -> None:
    if "timer" in parts:
        HttpToolsProtocol._unset_keepalive_if_required = lambda self: None

        def on_response_complete(self) -> None:  # uvicorn's, less the keep-alive timer
            self.server_state.total_requests += 1
            if not self.transport.is_closing():
                self.flow.resume_reading()

        HttpToolsProtocol.on_response_complete = on_response_complete
    if "scope" in parts:

        def on_message_begin(self) -> None:
            self.url, self.expect_100_continue, self.headers = b"", False, []

        HttpToolsProtocol.on_message_begin = on_message_begin
    if "metrics" in parts:
        import service.metrics

        class Nothing:
            def inc(self, *args) -> None:
                pass

        service.metrics.Metrics.child = lambda self, *labels: Nothing()


async def measure(requests: int) -> float:
    app = create_app(Settings(classify_model="classify-linformer", translate_model="", log_level="warning"))
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    config.load()
    app.build_middleware_stack()
    context = app.request_context
    context._min_refusals_per_s = 0  # every refusal answered at once
    room = context.admission["/classify"]
    room.in_flight, room.shedding = 10**9, True  # full, and shedding for good
    room._window_end = room._last_flooded_end = math.inf
    protocol = _admitting_protocol(app)(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    request = one_text_request("classify")
    for _ in range(2000):
        protocol.data_received(request)
    started = time.perf_counter()
    for _ in range(requests):
        protocol.data_received(request)
    seconds = time.perf_counter() - started
    if transport.refusals != requests + 2000:
        raise RuntimeError(f"{transport.refusals} of {requests + 2000} requests refused")
    return seconds / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--without", default="", help="comma-separated: timer, scope, metrics")
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    knock_out(set(filter(None, args.without.split(","))))
    print(f"{uvloop.run(measure(args.requests)):.2f} us per refusal (without: {args.without or 'nothing'})")


if __name__ == "__main__":
    main()
