"""Where one connection's request spends its time on the server (thirty-third session, issue #20): the service or
the floor, with a timestamp at four points of each request, taken by wrapping the functions there:

    recv       the protocol's data_received (the request's bytes are read)
    run0/run1  ClassifierRuntime.run begins / returns (session.run)
    write      the answer's bytes go to the transport

and at SIGINT the medians of recv -> run0, run0 -> run1, run1 -> write, and write -> the next recv (the client's
turn-around, and whatever the server still does after writing), over requests that went through all four in order
(the first fifth left out as warm-up). A development measurement: it patches the code it measures.

    LINFORMER_PORT=8231 LINFORMER_CLASSIFY_MODEL=classify-linformer LINFORMER_TRANSLATE_MODEL= \
        LINFORMER_ORT_INTRA_OP_THREADS=1 LINFORMER_ORT_INTER_OP_THREADS=1 LINFORMER_LOG_LEVEL=warning \
        taskset -c 0 python benchmarks/results/service-bench-session33/phases.py service
    taskset -c 0 python benchmarks/results/service-bench-session33/phases.py floor --port 8233 --max-batch 4
    taskset -c 1 wrk -t1 -c1 -d8s -s body16.lua http://127.0.0.1:8231/classify     # then SIGINT the server
"""

import atexit
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

marks: list[tuple[str, float]] = []
now = time.perf_counter


def mark(name: str) -> None:
    marks.append((name, now()))


def report() -> None:
    phases: dict[str, list[float]] = {"recv -> run": [], "run": [], "run -> write": [], "write -> next recv": []}
    names = [name for name, _ in marks]
    for i in range(1, len(marks) - 3):
        if names[i : i + 4] == ["recv", "run0", "run1", "write"]:
            t = [marks[i + j][1] for j in range(4)]
            phases["recv -> run"].append(t[1] - t[0])
            phases["run"].append(t[2] - t[1])
            phases["run -> write"].append(t[3] - t[2])
            if names[i - 1] == "write":
                phases["write -> next recv"].append(t[0] - marks[i - 1][1])
    for name, values in phases.items():
        values = values[len(values) // 5 :]
        print(f"{name}: {len(values)} requests, p50 {statistics.median(values) * 1e6:.1f} us", flush=True)


def wrap(owner: type, name: str, before: str | None = None, after: str | None = None) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            mark(before)
        result = original(*args, **kwargs)
        if after:
            mark(after)
        return result

    setattr(owner, name, wrapped)


def main() -> None:
    what, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    from service.runtime import ClassifierRuntime

    wrap(ClassifierRuntime, "run", before="run0", after="run1")
    atexit.register(report)
    if what == "floor":
        import benchmarks.peers.floor_classify as floor

        wrap(floor.Connection, "data_received", before="recv")

        class Transport:  # the floor writes each answer whole
            def __init__(self, transport):
                self.transport = transport

            def write(self, data: bytes) -> None:
                mark("write")
                self.transport.write(data)

            def __getattr__(self, name: str):
                return getattr(self.transport, name)

        made = floor.Connection.connection_made
        floor.Connection.connection_made = lambda self, transport: made(self, Transport(transport))
        signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
        floor.main()
        return
    import service.__main__ as server

    held = server._OneWriteResponses.write

    def write(self, data: bytes) -> None:
        if self.head is not None:  # the body's write, which sends the held head with it
            mark("write")
        held(self, data)

    server._OneWriteResponses.write = write
    protocol = server._admitting_protocol

    def admitting_protocol(app):
        cls = protocol(app)
        wrap(cls, "data_received", before="recv")
        return cls

    server._admitting_protocol = admitting_protocol
    server.main([])


if __name__ == "__main__":
    main()
