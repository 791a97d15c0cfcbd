"""Rolling-restart benchmark: SIGTERM one replica under keep-alive load and count the requests lost.

    python -m benchmarks.drain [--runs 10] [--clients 128] [--drain-s 5] [--compare-drain-s 0] [--one-replica]
                               [--out DIR]
    python -m benchmarks.drain --compose [--runs 10] [--clients 128] [--out DIR]

Two replicas of `python -m service` (the committed classify bundle): A is stopped with SIGTERM, B stays up.
`--clients` keep-alive clients (closed loop, one connection each) send /classify to A, as behind a load
balancer. A client moves to B when A tells it to (`Connection: close` on an answer, what the drain does) or
when its connection to A fails; a request that got no answer (connection reset, closed without an answer) is
lost. Each run: 2 s of load on A, SIGTERM, load until 1 s after A exited. Repeated `--runs` times with the
drain period given, and as many times with `--compare-drain-s` (0: uvicorn's plain graceful shutdown) to show
what the drain changes. Writes drain.{csv,md,png}.

`--one-replica`: no B. Clients reconnect to A itself after each `Connection: close` (a client with nowhere else to
go, or a load balancer that has not noticed yet), until A refuses the connection (refused: nothing was sent, the
client can retry elsewhere); a request sent and not answered is lost, as above. Writes drain-one-replica.*.

`--compose`: the same under Docker, as an operator runs it (compose.yaml at the repository root, its image built
first: `docker-compose build`, docker/README.md). The stack comes up with two `linformer` replicas behind the
HAProxy balancer; the clients keep their connections to the balancer (localhost:8000). Each run scales the
deployment down to one replica (`docker-compose up -d --no-deps --scale linformer=1 linformer`: compose stops one
container with SIGTERM and its `stop_grace_period`, then removes it) and back to two once the clients stop. A
request is lost when it gets no answer or any answer but 200 (a 502/503 from the balancer included). The stopped
replica's exit code comes from `docker events`: 0 is the drain finishing, 137 compose killing it at the end of the
grace period. The stack is taken down at the end. Writes drain-compose.*.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import REVIEW, Connection, Server, free_port, post_request  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)

TRANSPORT_ERRORS = (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError)


async def one_run(port_a: int, port_b: int | None, server_a: Server, clients: int, request: bytes) -> dict:
    """`port_b` None: clients reconnect to A until it refuses (`--one-replica`)."""
    counts = {"answered_by_a": 0, "answered_by_a_after_sigterm": 0, "answered_by_b": 0, "lost": 0,
              "non_200": 0, "moved_by_connection_close": 0, "moved_by_error": 0, "refused_at_connect": 0}  # fmt: skip
    sigterm_at: float | None = None
    latencies_after: list[float] = []

    async def move_on() -> tuple[Connection | None, bool]:
        """The connection a client goes on with once A closes its own, and whether it is to A; None: A refused."""
        if port_b is not None:
            return await Connection.open(port_b), False
        try:
            return await Connection.open(port_a), True
        except OSError:  # refused, or reset during the handshake: either way nothing was sent
            counts["refused_at_connect"] += 1
            return None, False

    async def client() -> None:
        conn = await Connection.open(port_a)
        on_a = True
        while not stop.is_set() and conn is not None:
            started = time.perf_counter()
            try:
                status, closing = await conn.exchange(request)
            except TRANSPORT_ERRORS:
                conn.close()
                if on_a:
                    counts["lost"] += 1
                    counts["moved_by_error"] += 1
                    conn, on_a = await move_on()
                    continue
                raise
            if status != 200:
                counts["non_200"] += 1
            if on_a:
                counts["answered_by_a"] += 1
                if sigterm_at is not None:
                    counts["answered_by_a_after_sigterm"] += 1
                    latencies_after.append(time.perf_counter() - started)
                if closing:  # the drain's signal: this replica is going away
                    counts["moved_by_connection_close"] += 1
                    conn.close()
                    conn, on_a = await move_on()
            else:
                counts["answered_by_b"] += 1
        if conn is not None:
            conn.close()

    stop = asyncio.Event()
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.sleep(2.0)
    sigterm_at = time.perf_counter()
    server_a.proc.send_signal(signal.SIGTERM)
    while server_a.proc.poll() is None:
        await asyncio.sleep(0.02)
    exit_s = time.perf_counter() - sigterm_at
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    return {**counts, "exit_code": server_a.proc.returncode, "sigterm_to_exit_s": round(exit_s, 2),
            "max_latency_after_sigterm_ms": round(max(latencies_after, default=0) * 1000, 1)}  # fmt: skip


COMPOSE = ["docker-compose"]  # v1.29 here (Debian's); `docker compose` (v2) reads the same compose.yaml
SERVICE, BALANCER_PORT, STATS = "linformer", 8000, "http://127.0.0.1:8404/;csv"


def scale(replicas: int) -> list[str]:
    """The compose arguments that scale the deployment alone: compose stops (and removes) what it scales away."""
    return ["up", "-d", "--no-deps", "--no-recreate", "--scale", f"{SERVICE}={replicas}", SERVICE]


def compose(*args: str) -> None:
    subprocess.run([*COMPOSE, *args], cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def balancer_servers_up() -> int:
    """How many servers of the deployment's backend the balancer has UP (its stats page as CSV)."""
    try:
        rows = urllib.request.urlopen(STATS, timeout=2).read().decode().splitlines()
    except OSError:
        return 0
    return sum(1 for row in rows if row.startswith(f"{SERVICE},{SERVICE}-") and ",UP," in row)


def scale_to(replicas: int, timeout_s: float = 180) -> None:
    """Scale the deployment and wait until the balancer sends to exactly that many replicas."""
    compose(*scale(replicas))
    deadline = time.monotonic() + timeout_s
    while balancer_servers_up() != replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the balancer did not see {replicas} {SERVICE} replicas UP in {timeout_s:.0f} s")
        time.sleep(0.5)


async def compose_run(clients: int, request: bytes) -> dict:
    """One scale-down from two replicas to one under `clients` keep-alive clients on the balancer."""
    counts = {"answered": 0, "answered_after_stop": 0, "lost": 0, "non_200": 0, "transport_errors": 0}
    stop_at: float | None = None
    latencies_after: list[float] = []

    async def client() -> None:
        conn = await Connection.open(BALANCER_PORT)
        while not stop.is_set():
            started = time.perf_counter()
            try:
                status, closing = await conn.exchange(request)
            except TRANSPORT_ERRORS:
                conn.close()
                counts["lost"] += 1
                counts["transport_errors"] += 1
                conn = await Connection.open(BALANCER_PORT)
                continue
            if status == 200:
                counts["answered"] += 1
                if stop_at is not None:
                    counts["answered_after_stop"] += 1
                    latencies_after.append(time.perf_counter() - started)
            else:
                counts["lost"] += 1
                counts["non_200"] += 1
            if closing:
                conn.close()
                conn = await Connection.open(BALANCER_PORT)
        conn.close()

    # the stopped replica's exit, whichever compose picks
    events = await asyncio.create_subprocess_exec(
        "docker", "events", "--filter", "event=die", "--filter", f"label=com.docker.compose.service={SERVICE}",
        "--format", "{{.Actor.Attributes.name}} {{.Actor.Attributes.exitCode}}",
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.sleep(2.0)
    stop_at = time.perf_counter()
    scaling = await asyncio.create_subprocess_exec(*COMPOSE, *scale(1), cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    name, _, exit_code = (await events.stdout.readline()).decode().strip().partition(" ")
    exit_s = time.perf_counter() - stop_at
    events.terminate()
    await events.wait()
    await scaling.wait()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    return {**counts, "stopped": name, "exit_code": int(exit_code), "stop_to_exit_s": round(exit_s, 2),
            "max_latency_after_stop_ms": round(max(latencies_after, default=0) * 1000, 1)}  # fmt: skip


def main_compose(args: argparse.Namespace) -> None:
    load_before = load_average()
    request = post_request("/classify", json.dumps({"text": REVIEW}).encode())
    compose("up", "-d", "--scale", f"{SERVICE}=2")
    rows = []
    try:
        for run in range(args.runs):
            scale_to(2)
            rows.append({"run": run + 1, **asyncio.run(compose_run(args.clients, request))})
            print(rows[-1], flush=True)
    finally:
        compose("down")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "drain-compose"
    write_csv(args.out / f"{name}.csv", rows)
    plot([{**row, "drain_s": 5.0} for row in rows], args.out / f"{name}.png", args.clients)
    versions = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
    compose_version = subprocess.run([*COMPOSE, "version", "--short"], capture_output=True, text=True).stdout.strip()
    columns = {"run": "run", "answered": "answered 200", "answered_after_stop": "200 after the stop", "lost": "lost",
               "non_200": "non-200", "transport_errors": "no answer", "stopped": "replica stopped",
               "exit_code": "its exit code", "stop_to_exit_s": "stop -> exit (s)",
               "max_latency_after_stop_ms": "max latency after the stop (ms)"}  # fmt: skip
    lines = header(f"Rolling restart under Docker: a replica scaled away under {args.clients} keep-alive clients",
                   ("uvicorn",), load_before)  # fmt: skip
    lines += [
        f"- engine: Docker {versions}; compose: {COMPOSE[0]} {compose_version}; image `linformer-serve:cpu` "
        "(compose.yaml: `cpus: 1.0`, one ORT thread, `stop_grace_period: 50s`, `LINFORMER_DRAIN_S` 5 s)",
        "",
        f"compose.yaml's stack with two `{SERVICE}` replicas behind the HAProxy balancer; {args.clients} keep-alive "
        f"clients (closed loop, raw asyncio HTTP/1.1) send /classify to the balancer (localhost:{BALANCER_PORT}); "
        f"after 2 s `docker-compose up -d --no-deps --scale {SERVICE}=1 {SERVICE}` stops one replica (SIGTERM, "
        "then the grace period) and removes it; the clients stop 1 s after it exited, and the deployment is scaled "
        "back to two (both UP in the balancer) before the next run. Lost: a request with no answer or an answer "
        "other than 200.",
        "",
        "| runs | requests lost (total) | runs with a loss | replica exited 0 | stop -> exit |",
        "|---|---|---|---|---|",
        f"| {summary_cells(rows, 'stop_to_exit_s')}",
    ]  # fmt: skip
    write_report(args.out / f"{name}.md", lines, rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--compare-drain-s", type=float, default=0.0)
    parser.add_argument("--one-replica", action="store_true", help="no B: clients reconnect to A (module docstring)")
    parser.add_argument("--compose", action="store_true", help="under Docker compose (module docstring)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.compose:
        main_compose(args)
        return
    load_before = load_average()
    env = {"LINFORMER_TRANSLATE_MODEL": "", "LINFORMER_LOG_LEVEL": "warning", "LINFORMER_ORT_INTRA_OP_THREADS": "1",
           "LINFORMER_MAX_CONCURRENT_REQUESTS": str(args.clients)}  # fmt: skip
    request = post_request("/classify", json.dumps({"text": REVIEW}).encode())
    port_b = None if args.one_replica else free_port()
    server_b = None if args.one_replica else Server(port_b, env, cores=None)
    name = "drain-one-replica" if args.one_replica else "drain"
    rows = []
    try:
        for drain_s in (args.drain_s, args.compare_drain_s):
            for run in range(args.runs):
                port_a = free_port()
                server_a = Server(port_a, {**env, "LINFORMER_DRAIN_S": str(drain_s)}, cores=None)
                result = asyncio.run(one_run(port_a, port_b, server_a, args.clients, request))
                server_a.stop()
                rows.append({"drain_s": drain_s, "run": run + 1, **result})
                print(rows[-1], flush=True)
    finally:
        if server_b is not None:
            server_b.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    plot(rows, args.out / f"{name}.png", args.clients)
    columns = {"drain_s": "drain s", "run": "run", "answered_by_a": "answered by A",
               "answered_by_a_after_sigterm": "by A after SIGTERM", "lost": "lost",
               "moved_by_connection_close": "moved by Connection: close", "moved_by_error": "moved by an error",
               "refused_at_connect": "refused at connect",
               "non_200": "non-200", "exit_code": "A's exit code", "sigterm_to_exit_s": "SIGTERM -> exit (s)",
               "max_latency_after_sigterm_ms": "max latency after SIGTERM (ms)"}  # fmt: skip
    lines = header(f"Rolling restart: SIGTERM under {args.clients} keep-alive clients", ("onnxruntime", "uvicorn"),
                   load_before)  # fmt: skip
    by_drain = {}
    for row in rows:
        by_drain.setdefault(row["drain_s"], []).append(row)
    setup = (
        "One replica of `python -m service` (classify-linformer, 1 ORT thread, unpinned), A; "
        f"{args.clients} keep-alive clients (closed loop, raw asyncio HTTP/1.1) on A; SIGTERM to A after 2 s; a "
        "client reconnects to A after `Connection: close` or a failed request (which counts as lost) until A "
        "refuses the connection (refused at connect: nothing sent)."
        if args.one_replica else
        "Two replicas of `python -m service` (classify-linformer, 1 ORT thread, unpinned), A and B; "
        f"{args.clients} keep-alive clients (closed loop, raw asyncio HTTP/1.1) on A; SIGTERM to A after 2 s; a "
        "client moves to B on `Connection: close` or on a failed request, which counts as lost."
    )  # fmt: skip
    lines += [
        f"{setup} The machine is shared with other jobs (load average above).",
        "",
        "| LINFORMER_DRAIN_S | runs | requests lost (total) | runs with a loss | A exited 0 | SIGTERM -> exit |",
        "|---|---|---|---|---|---|",
        *[f"| {drain:g} | {summary_cells(group, 'sigterm_to_exit_s')}" for drain, group in by_drain.items()],
    ]  # fmt: skip
    write_report(args.out / f"{name}.md", lines, rows, columns)


def summary_cells(group: list[dict], exit_s: str) -> str:
    """Runs, requests lost, runs with a loss, exits 0 and the signal-to-exit range, as the cells of a table row."""
    return (f"{len(group)} | {sum(r['lost'] for r in group)} | {sum(r['lost'] > 0 for r in group)} | "
            f"{sum(r['exit_code'] == 0 for r in group)}/{len(group)} | "
            f"{min(r[exit_s] for r in group):.1f}-{max(r[exit_s] for r in group):.1f} s |")  # fmt: skip


def write_report(path: Path, lines: list[str], rows: list[dict], columns: dict[str, str]) -> None:
    """The summary `lines`, then every run's row and the plot (saved beside it as the same name .png)."""
    write_markdown(path, [*lines, "", *markdown_table(rows, columns), "",
                          f"![requests lost per run]({path.stem}.png)", ""])  # fmt: skip


def plot(rows: list[dict], path: Path, clients: int) -> None:
    fig, axis = agg_subplots(figsize=(8, 3.5))
    drains = sorted({row["drain_s"] for row in rows}, reverse=True)
    width = 0.8 / len(drains)
    for i, drain in enumerate(drains):
        group = [row for row in rows if row["drain_s"] == drain]
        axis.bar([row["run"] + (i - (len(drains) - 1) / 2) * width for row in group], [row["lost"] for row in group],
                 width=width, label=f"LINFORMER_DRAIN_S={drain:g}")  # fmt: skip
    axis.set_xlabel("run")
    axis.set_ylabel("requests lost")
    axis.set_title(f"SIGTERM under {clients} keep-alive clients", fontsize=10)
    axis.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
