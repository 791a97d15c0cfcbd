"""What the overload, soak and drain benchmarks share: a served process pinned to one core, and a raw asyncio
HTTP/1.1 load generator that records every request (when it was due, how long it took, its status).

Open loop (`open_loop`): requests are due at a fixed rate whatever the server does, as from many independent
users; a request waiting for a free connection is late, and its latency counts from when it was due (no
coordinated omission). Closed loop (`closed_loop`): N keep-alive clients, each sending its next request when
the last one is answered. Status 0 is a transport error (connection reset or closed without an answer).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.__main__ import raise_open_files_limit  # noqa: E402

REVIEW = ("The film was a moving story with great music and a brilliant ending, but the plot felt long in "
          "the middle and the actors were not always convincing. Still, I would watch it again with friends.")
# what a /translate request sends in these benchmarks: one sentence of the kind the translators were trained on
SENTENCE = "Click the Save button to store your changes in the current document."


@dataclass
class Record:
    due_s: float  # when the request was due, seconds from the start of the run
    latency_s: float  # due -> answer read (or error)
    status: int  # 0: transport error, no answer
    lag_s: float = 0.0  # due -> written to a connection: the generator's own delay (or waiting for a connection)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


def service_at(ref: str, into: Path) -> Path:
    """A tree holding `service/` as it was at git `ref`, extracted under `into`: run with `python -m service` from
    it (Server's `tree`), the service of an earlier commit is measured in the same run as this one."""
    tree = into / f"service-at-{ref}"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, "service"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def wait_until_ready(proc: subprocess.Popen, port: int, timeout_s: float = 60) -> None:
    """Poll /readyz of a server process just started until it answers 200; raise if it exits or times out."""
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


class Server:
    """`python -m service` in its own process, optionally pinned to CPU cores with `taskset`."""

    def __init__(self, port: int, env: dict[str, str], cores: str | None = "0", log: Path | None = None,
                 tree: Path = REPO):  # fmt: skip
        """`tree`: the checkout whose `service` runs (another commit's, to compare with it in one session)."""
        self.port, self.env = port, env
        command = [sys.executable, "-m", "service", "--port", str(port)]
        if cores is not None:
            command = ["taskset", "-c", cores, *command]
        self.log = open(log or os.devnull, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(command, cwd=tree, env={**os.environ, **env}, stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        wait_until_ready(self.proc, port)

    def rss_mb(self) -> float:
        """Resident memory of the server process (the taskset child execs into python, same pid)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds so far of the server's event-loop thread (its main thread) and of its other threads."""
        loop = main_thread_cpu_s(self.proc.pid)
        return loop, _cpu_s(Path(f"/proc/{self.proc.pid}/stat")) - loop

    def stop(self, sig: int = 15, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


def _cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a /proc stat file (a process's: all its threads; a task's: that thread)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread: for this service, the event loop (HTTP, parsing, tokenising,
    answers); its compute threads make up the rest of the process's."""
    return _cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))


def bundle_task(bundle: str, tree: Path = REPO) -> str:
    """"classify" or "translate": the task of the bundle models/<bundle> in `tree`."""
    return json.loads((tree / "models" / bundle / "config.json").read_text())["task"]


def one_text_request(task: str) -> bytes:
    """The request these benchmarks send to a task's route: REVIEW to /classify, SENTENCE to /translate."""
    return post_request(f"/{task}", json.dumps({"text": REVIEW if task == "classify" else SENTENCE}).encode())


def server_on_core_0(bundle: str, settings: list[str], tree: Path = REPO) -> Server:
    """The measured set-up of overload and soak: one bundle (its task's only model), 1 ORT thread, the server on
    core 0 and this process (the load) on core 1; `settings` are extra `LINFORMER_X=value` strings."""
    task = bundle_task(bundle, tree)
    env = {"LINFORMER_CLASSIFY_MODEL": "", "LINFORMER_TRANSLATE_MODEL": "", f"LINFORMER_{task.upper()}_MODEL": bundle,
           "LINFORMER_ORT_INTRA_OP_THREADS": "1", "LINFORMER_ORT_INTER_OP_THREADS": "1",
           "LINFORMER_LOG_LEVEL": "warning", **dict(s.split("=", 1) for s in settings)}  # fmt: skip
    server = Server(free_port(), env, cores="0", tree=tree)
    pin_to({1})
    return server


# uvicorn closes a keep-alive connection idle for 5 s; like any HTTP client pool, ours drops idle connections
# before that instead of racing the server's close (which would count as a transport error here)
IDLE_LIMIT_S = 4.0


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def exchange(self, request: bytes) -> tuple[int, bool]:
        """Send one request, read its answer: (status, whether the server will close the connection)."""
        self.writer.write(request)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("closed without an answer")
        status = int(status_line.split()[1])
        length, closing = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                closing = True
        await self.reader.readexactly(length)
        self.idle_since = time.monotonic()
        return status, closing

    def close(self) -> None:
        self.writer.close()


async def open_loop(port: int, request: bytes, phases: list[tuple[float, float]], max_connections: int = 2048,
                    started: float | None = None) -> list[Record]:  # fmt: skip
    """`phases`: (seconds, requests per second) one after the other; every request recorded."""
    raise_open_files_limit()  # a connection is a file: the usual soft limit of 1,024 is less than max_connections
    records: list[Record] = []
    idle: list[Connection] = []
    opened = 0
    available = asyncio.Condition()
    started = started if started is not None else time.perf_counter()

    async def one(due: float) -> None:
        nonlocal opened
        async with available:
            while not idle and opened >= max_connections:
                await available.wait()
            conn = idle.pop() if idle else None
            while conn is not None and time.monotonic() - conn.idle_since > IDLE_LIMIT_S:
                conn.close()
                opened -= 1
                conn = idle.pop() if idle else None
            if conn is None:
                opened += 1
        status = 0
        lag = time.perf_counter() - started - due
        try:
            if conn is None:
                conn = await Connection.open(port)
            status, closing = await conn.exchange(request)
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            closing = True
        records.append(Record(due, time.perf_counter() - started - due, status, lag))
        async with available:
            if closing:
                if conn is not None:
                    conn.close()
                opened -= 1
            else:
                idle.append(conn)
            available.notify()

    tasks: set[asyncio.Task] = set()
    phase_start = 0.0
    next_freeze = 0.0
    for seconds, rate in phases:
        n = int(seconds * rate)
        for i in range(n):
            due = phase_start + i / rate
            if due >= next_freeze:
                # Records pile up (600k in a 10-minute soak) and the collector's full passes walk them all: they
                # grew to 60-200 ms, during which nothing was sent, then a burst of a few hundred requests hit the
                # server. Freezing (cheap) once a second keeps them out of reach.
                gc.freeze()
                next_freeze = due + 1.0
            delay = due - (time.perf_counter() - started)
            if delay > 0.001:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        phase_start += seconds
    if tasks:
        await asyncio.gather(*tasks)
    for conn in idle:
        conn.close()
    return records


async def closed_loop(port: int, request: bytes, clients: int, seconds: float,
                      started: float | None = None) -> list[Record]:  # fmt: skip
    raise_open_files_limit()  # a connection is a file: the soak's backlog turns keep 1,100 open
    records: list[Record] = []
    started = started if started is not None else time.perf_counter()
    stop_at = started + seconds

    async def client() -> None:
        conn = None
        while time.perf_counter() < stop_at:
            due = time.perf_counter() - started
            status = 0
            try:
                conn = conn or await Connection.open(port)
                status, closing = await conn.exchange(request)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
                closing = True
            records.append(Record(due, time.perf_counter() - started - due, status))
            if closing and conn is not None:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return records


def peak_outstanding(records: list[Record], window_s: float) -> dict[int, int]:
    """Window index -> the most requests sent and not yet answered at any moment in it: what the server had in
    progress (plus the network's share), the figure its admission limit compares with."""
    events = sorted([(r.due_s + r.lag_s, 1) for r in records] + [(r.due_s + r.latency_s, -1) for r in records])
    peaks: dict[int, int] = {}
    outstanding = 0
    for t, change in events:
        outstanding += change
        window = int(t / window_s)
        peaks[window] = max(peaks.get(window, 0), outstanding)
    return peaks


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def pin_to(cores: set[int]) -> None:
    """Keep the load generator off the server's core (no-op where affinity is not available)."""
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass
