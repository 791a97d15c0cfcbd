"""/translate under mixed-length closed-loop load: our service (request- or step-level scheduling, fp32 or int8)
against the CTranslate2 peer on the same weights (a benchmark, not a test).

Every deployment is a separate server process pinned with taskset to the same core (1), with 1 thread
(LINFORMER_ORT_INTRA_OP_THREADS=1 / INTER=1; CTranslate2 intra_threads 1, inter_threads 1); this process, the
load, runs on core 0. Deployments are named:
- `ours-<request|step>-<fp32|int8>`: `python -m service` with LINFORMER_TRANSLATE_MODEL=translate-transformer
  (or translate-transformer-int8), LINFORMER_TRANSLATE_SCHEDULING=request|step, no classifier;
- `ct2-<fp32|int8>`: benchmarks/ctranslate2_server.py (FastAPI around translate_batch) with compute_type
  float32 or int8.

Load: N closed-loop users (keep-alive HTTP/1.1, no think time), each sending one text per request: a held-out
EN-DE test source cut to exactly n tokens (loadtest/texts.py), n drawn uniformly from the lengths (8-256), greedy,
max_new_tokens = 2n + 8 as the Locust file sends. Each user's sequence of lengths is seeded by its index, so
every deployment gets the same requests in the same order. For each user count, the deployments take turns
(the order rotating), after one sequential request per length; then the users run --warmup + --duration seconds
and only the requests sent in the last --duration are recorded (batch shapes that only form under load allocate on
first use, and the users' simultaneous first requests are not the steady state; until issue #17's fourth round the
warm-up was a loop of its own and the recorded loop began with that burst too). Latency percentiles are per
source-length bucket over every request sent in the recorded window (the last ones finish after the clock);
throughput counts the generated tokens (the reply's `tokens`) of the replies that arrived within it, whenever sent.

    .venv/bin/python -m benchmarks.translate_load --deployments ours-request-fp32,ct2-fp32 --users 1,4,16 \
        --duration 30 [--out benchmarks/results/translate-load]

A deployment of ours may name a git commit, `ours-request-fp32@9a9d932`: the service as it was there (its
`service/`, loadgen.service_at) with today's models, measured in the same run as the others; and settings of
its own, `ours-request-fp32+translate_cut_in_ratio=0` (LINFORMER_TRANSLATE_CUT_IN_RATIO=0 for that server).

This is also the step- vs request-level benchmark (benchmarks/stepbatch.py, which drove the same kind of load
against our service alone, was folded into it): `--deployments ours-request-fp32,ours-step-fp32`, and
`--bundle translate-linformer` for the Linformer translator (our deployments only: CTranslate2 has no low-rank
attention).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import (  # noqa: E402
    Connection,
    Server,
    free_port,
    pin_to,
    post_request,
    service_at,
    wait_until_ready,
)
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from loadtest.texts import texts_of_length, translate_max_new_tokens  # noqa: E402

LENGTHS = (8, 16, 32, 64, 128, 256)
SHORT = 32  # the short requests: at most 32 source tokens
SERVER_CORE, LOAD_CORE = "1", {0}
BUNDLE = "translate-transformer"  # the default: the one vanilla translator both engines can run


@dataclass
class Record:
    n: int
    sent_s: float  # from the start of the recorded window (negative: sent in the warm-up)
    latency_s: float
    status: int  # 0: transport error
    tokens: int  # generated tokens in the reply
    in_window: bool  # the reply arrived within the recorded window (it counts towards throughput)


def start(deployment: str, models_dir: Path, log_dir: Path, fp32_bundle: str = BUNDLE):
    """Start one deployment pinned to SERVER_CORE; returns (port, stop())."""
    port = free_port()
    log = log_dir / f"server-{deployment}.log"
    deployment, *overrides = deployment.split("+")
    settings = {f"LINFORMER_{key.upper()}": value for key, _, value in (o.partition("=") for o in overrides)}
    name, _, ref = deployment.partition("@")
    parts = name.split("-")
    precision = parts[-1]
    bundle = fp32_bundle if precision == "fp32" else f"{fp32_bundle}-int8"
    if parts[0] == "ours":
        env = {"LINFORMER_MODELS_DIR": str(models_dir), "LINFORMER_TRANSLATE_MODEL": bundle,
               "LINFORMER_CLASSIFY_MODEL": "", "LINFORMER_TRANSLATE_SCHEDULING": parts[1],
               "LINFORMER_ORT_INTRA_OP_THREADS": "1", "LINFORMER_ORT_INTER_OP_THREADS": "1",
               "LINFORMER_EXECUTION_PROVIDER": "cpu", "LINFORMER_LOG_LEVEL": "warning", **settings}  # fmt: skip
        server = Server(port, env, cores=SERVER_CORE, log=log, tree=service_at(ref, log_dir) if ref else REPO)
        return port, server.stop
    if settings:
        raise SystemExit(f"{deployment}: settings (+name=value) are for our service's deployments only")
    compute_type = {"fp32": "float32", "int8": "int8"}[precision]
    command = ["taskset", "-c", SERVER_CORE, sys.executable, "-m", "benchmarks.ctranslate2_server",
               "--bundle", str(models_dir / fp32_bundle), "--compute-type", compute_type, "--threads", "1",
               "--port", str(port)]  # fmt: skip
    out = open(log, "w")  # noqa: SIM115  (closed by stop)
    proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wait_until_ready(proc, port, timeout_s=120)

    def stop() -> None:
        proc.terminate()
        proc.wait(30)
        out.close()

    return port, stop


def check_scheduling_is_served(deployments: list[str]) -> None:
    """A `step` deployment needs a service that knows the setting; an unknown LINFORMER_ variable is ignored,
    and the run would silently measure request-level batching under the name step."""
    from service.config import Settings

    if any("-step-" in d for d in deployments) and "translate_scheduling" not in Settings.model_fields:
        raise SystemExit("this service has no LINFORMER_TRANSLATE_SCHEDULING: merge step-level batching first")


async def exchange(conn: Connection, request: bytes) -> tuple[int, dict]:
    """One request on a keep-alive connection: (status, JSON body)."""
    conn.writer.write(request)
    status_line = await conn.reader.readline()
    if not status_line:
        raise ConnectionError("closed without an answer")
    length = 0
    while (line := await conn.reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await conn.reader.readexactly(length)
    return int(status_line.split()[1]), json.loads(body) if body else {}


def request_for(n: int, variant: int, max_new_tokens: int | None = None) -> bytes:
    """`max_new_tokens`: None for the Locust file's 2n + 8 (requests of different lengths are then never batched
    together: their options differ), a number to send that for every length (the API's default is 256)."""
    texts = texts_of_length("translate", n)
    # whole texts of n tokens (not cut into sentences), as the CTranslate2 peer translates them
    body = {"texts": [texts[variant % len(texts)]], "truncate": True, "beam_size": 1, "split_sentences": False,
            "max_new_tokens": max_new_tokens or translate_max_new_tokens(n)}  # fmt: skip
    return post_request("/translate", json.dumps(body).encode())


async def closed_loop(
    port: int, users: int, seconds: float, lengths: tuple[int, ...], warmup_s: float = 0.0, slice_index: int = 0,
    max_new_tokens: int | None = None,
) -> list[Record]:
    """`users` closed-loop users for warmup_s + seconds; every request is recorded (times from the start of the last
    `seconds`, the window: a request sent in the warm-up has a negative `sent_s`). The users start together, so the
    first requests arrive as one burst; measuring after a warm-up in the same loop measures the steady state, not
    that burst (which a load test with staggered starts, such as Locust's spawn rate, does not have either).
    `slice_index` picks another seeded sequence of lengths (the same for every deployment)."""
    records: list[Record] = []
    started = time.perf_counter() + warmup_s  # the recorded window's start

    async def user(index: int) -> None:
        rng = random.Random(index + 1_000_003 * slice_index)  # the same request sequence for every deployment
        conn, sent = await Connection.open(port), 0
        while (now := time.perf_counter() - started) < seconds:
            n = rng.choice(lengths)
            try:
                status, body = await exchange(conn, request_for(n, sent, max_new_tokens))
                tokens = body["translations"][0]["tokens"] if status == 200 else 0
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, KeyError):
                status, tokens = 0, 0
                conn.close()
                conn = await Connection.open(port)
            latency = time.perf_counter() - started - now
            records.append(Record(n, now, latency, status, tokens, 0 <= now + latency <= seconds))
            sent += 1
        conn.close()

    await asyncio.gather(*(user(i) for i in range(users)))
    return records


def warm_up(port: int, lengths: tuple[int, ...]) -> None:
    async def run() -> None:
        conn = await Connection.open(port)
        for n in lengths:
            await exchange(conn, request_for(n, 0))
        conn.close()

    asyncio.run(run())


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarise(deployment: str, users: int, seconds: float, records: list[Record], load: str) -> tuple[dict, list]:
    """Latencies of the requests sent in the window; throughput from the replies that arrived in it, whenever sent.
    (Counting only replies both sent and answered in the window undercounts, and the more so the longer a request
    takes: the one a user has in flight at the window's end is length-biased, most often a long one.)"""
    in_time = [r for r in records if r.status == 200 and r.in_window]
    records = [r for r in records if r.sent_s >= 0]
    ok = [r for r in records if r.status == 200]
    short = [1000 * r.latency_s for r in ok if r.n <= SHORT]
    generated = sum(r.tokens for r in in_time)
    row = {"deployment": deployment, "users": users, "seconds": seconds, "requests": len(records),
           "errors": len(records) - len(ok), "generated_tokens_per_s": round(generated / seconds, 1),
           "requests_per_s": round(len(in_time) / seconds, 2),
           "short_p50_ms": percentile(short, 50), "short_p99_ms": percentile(short, 99), "short_requests": len(short),
           "p50_ms": percentile([1000 * r.latency_s for r in ok], 50),
           "p99_ms": percentile([1000 * r.latency_s for r in ok], 99), "load_before": load}  # fmt: skip
    buckets = []
    for n in sorted({r.n for r in records}):
        mine = [r for r in ok if r.n == n]
        times = [1000 * r.latency_s for r in mine]
        buckets.append({"deployment": deployment, "users": users, "n": n, "requests": len(mine),
                        "p50_ms": percentile(times, 50), "p99_ms": percentile(times, 99),
                        "mean_generated_tokens": round(statistics.mean(r.tokens for r in mine), 1) if mine else None,
                        })  # fmt: skip
    for key in ("short_p50_ms", "short_p99_ms", "p50_ms", "p99_ms"):
        row[key] = None if row[key] is None else round(row[key], 1)
    for bucket in buckets:
        for key in ("p50_ms", "p99_ms"):
            bucket[key] = None if bucket[key] is None else round(bucket[key], 1)
    return row, buckets


def _verdict(met: bool) -> str:
    """Met or missed, from the unrounded ratio: a printed 0.80x can be 0.796x."""
    return "met" if met else "**missed**"


def goals(rows: list[dict]) -> list[str]:
    """The issue's ratios, from this run's rows, where both sides were measured."""
    at = {(r["deployment"], r["users"]): r for r in rows}
    most = max(r["users"] for r in rows)
    lines = []

    def ratio(a: tuple, b: tuple, key: str) -> float | None:
        if a in at and b in at and at[a][key] and at[b][key]:
            return at[a][key] / at[b][key]
        return None

    for precision in ("fp32", "int8"):
        step, request, peer = f"ours-step-{precision}", f"ours-request-{precision}", f"ct2-{precision}"
        x = ratio((step, most), (request, most), "generated_tokens_per_s")
        if x is not None:
            lines.append(f"- {precision}: step-level / request-level throughput at {most} users: **{x:.3f}×** "
                         f"(goal ≥ 1.5×): {_verdict(x >= 1.5)}")  # fmt: skip
        x = ratio((step, most), (step, 1), "short_p99_ms")
        if x is not None:
            lines.append(f"- {precision}: step-level short-request p99 at {most} users / at 1 user: **{x:.3f}×** "
                         f"(goal ≤ 2×): {_verdict(x <= 2)}")  # fmt: skip
        for ours in (step, request):
            x = ratio((ours, 1), (peer, 1), "generated_tokens_per_s")
            if x is not None:
                lines.append(f"- {precision}: {ours} / {peer} throughput at 1 user (single stream): **{x:.3f}×** "
                             f"(goal ≥ 0.8×): {_verdict(x >= 0.8)}")  # fmt: skip
            x = ratio((ours, most), (peer, most), "generated_tokens_per_s")
            y = ratio((peer, most), (ours, most), "short_p99_ms")
            if x is not None and y is not None:
                lines.append(f"- {precision}: {ours} / {peer} at {most} users: throughput **{x:.3f}×** (goal > 1), "
                             f"short-request p99 {at[(ours, most)]['short_p99_ms']:.0f} ms against "
                             f"{at[(peer, most)]['short_p99_ms']:.0f} ms (**{y:.3f}×** as fast; goal > 1): "
                             f"{_verdict(x > 1 and y > 1)}")  # fmt: skip
    for engine in ("ours-request", "ours-step", "ct2"):
        for users in sorted({r["users"] for r in rows}):
            x = ratio((f"{engine}-int8", users), (f"{engine}-fp32", users), "generated_tokens_per_s")
            if x is not None:
                lines.append(f"- {engine}: int8 / fp32 throughput at {users} user(s): {x:.2f}×")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    fig, (left, right) = agg_subplots(1, 2, figsize=(11, 4.2))
    for i, deployment in enumerate(dict.fromkeys(r["deployment"] for r in rows)):
        mine = sorted((r for r in rows if r["deployment"] == deployment), key=lambda r: r["users"])
        users = [r["users"] for r in mine]
        style = {"color": f"C{i}", "marker": "o", "ls": "-" if deployment.endswith("fp32") else "--"}
        left.plot(users, [r["short_p99_ms"] for r in mine], label=deployment, **style)
        right.plot(users, [r["generated_tokens_per_s"] for r in mine], label=deployment, **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("closed-loop users")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel(f"p99 latency of requests with ≤ {SHORT} source tokens (ms)")
    left.set_title("short requests under mixed-length load")
    right.set_ylabel("generated tokens / s")
    right.set_title("throughput")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.translate_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", default="ours-request-fp32,ct2-fp32", type=lambda s: s.split(","))
    parser.add_argument("--users", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--duration", type=float, default=30, help="seconds of load per (deployment, users)")
    parser.add_argument("--warmup", type=float, default=3,
                        help="seconds of load before each run (or turn) whose requests give no latencies")
    parser.add_argument("--max-new-tokens", type=int, help="the same for every length (default: 2n + 8 per length)")
    parser.add_argument("--slices", type=int, default=1,
                        help="measure each point in this many turns of duration/slices s, the deployments taking turns "
                             "(this VM's speed drifts by up to ~25 %% within minutes: finer turns share the drift)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), type=lambda s: tuple(map(int, s.split(","))))
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--bundle", default=BUNDLE, help="fp32 bundle; int8: <bundle>-int8 (ct2: vanilla only)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "translate-load")
    args = parser.parse_args(argv)
    check_scheduling_is_served(args.deployments)
    for n in args.lengths:  # cut (and cache) the texts before any timing
        texts_of_length("translate", n)
    load_before = load_average()
    log_dir = REPO / ".cache" / f"{args.out.name}-logs"  # server logs: not results
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for deployment in args.deployments:
            servers[deployment] = start(deployment, args.models_dir.resolve(), log_dir, args.bundle)
        pin_to(LOAD_CORE)
        rows, buckets = [], []
        slice_s = args.duration / args.slices
        for u, users in enumerate(args.users):
            records: dict[str, list[Record]] = {deployment: [] for deployment in args.deployments}
            loads = {}
            for s in range(args.slices):
                turn = (u + s) % len(args.deployments)
                for deployment in args.deployments[turn:] + args.deployments[:turn]:
                    port = servers[deployment][0]
                    if s == 0:
                        warm_up(port, args.lengths)
                        loads[deployment] = load_average()
                    # no latencies from requests sent in the first --warmup seconds (batch shapes only seen under load
                    # allocate on first use); their replies that arrive in the window count towards throughput
                    records[deployment] += asyncio.run(closed_loop(port, users, slice_s, args.lengths, args.warmup, s,
                                                                   args.max_new_tokens))  # fmt: skip
            for deployment in args.deployments:
                row, per_bucket = summarise(deployment, users, args.duration, records[deployment], loads[deployment])
                rows.append(row)
                buckets += per_bucket
                print(json.dumps(row), flush=True)
    finally:
        for _, stop in servers.values():
            stop()

    stem = args.out
    write_csv(stem.with_suffix(".csv"), rows)
    write_csv(stem.with_name(stem.name + "-buckets.csv"), buckets)
    plot(rows, stem.with_suffix(".png"))
    lines = header("/translate under mixed-length load: request- vs step-level, fp32 vs int8, ours vs CTranslate2",
                   ("onnxruntime", "ctranslate2", "fastapi", "uvicorn"), load_before)  # fmt: skip
    lines += [
        f"Deployments: {', '.join(args.deployments)}; each its own server process pinned to core {SERVER_CORE} with "
        f"1 thread, the load on core {sorted(LOAD_CORE)[0]}; model `{args.bundle}` (int8: `{args.bundle}-int8` for "
        "ours, compute_type int8 for CTranslate2 on the fp32 weights); our service at its default batching limits.",
        f"Load: closed loop, {args.duration:g} s per (deployment, users)"
        + (f" in {args.slices} turns of {slice_s:g} s (the deployments taking turns, each turn after "
           f"{args.warmup:g} s unrecorded)" if args.slices > 1 else "")
        + f", users {args.users}; source lengths "
        f"{list(args.lengths)} tokens drawn uniformly per request (seeded per user: every deployment gets the same "
        "sequence), greedy, max_new_tokens = "
        + (f"{args.max_new_tokens} for every length" if args.max_new_tokens else "2n + 8")
        + "; one text per request. Short = at most "
        f"{SHORT} source tokens. Generated tokens/s counts replies that arrived within the duration.",
        "",
        "## Goals (issue #17), from this run",
        "",
        *(goals(rows) or ["- (no pair of deployments measured here bears on a goal)"]),
        "",
        "## Per deployment and user count",
        "",
        *markdown_table(rows, {"deployment": "deployment", "users": "users", "requests": "requests",
                               "errors": "errors", "generated_tokens_per_s": "generated tokens/s",
                               "requests_per_s": "req/s", "short_p50_ms": f"p50 ≤{SHORT} ms",
                               "short_p99_ms": f"p99 ≤{SHORT} ms", "p50_ms": "p50 all ms", "p99_ms": "p99 all ms",
                               "load_before": "load before"}),  # fmt: skip
        "",
        f"![short-request p99 and throughput]({stem.name}.png)",
        "",
        "## Per source-length bucket",
        "",
        *markdown_table(buckets, {"deployment": "deployment", "users": "users", "n": "source tokens",
                                  "requests": "requests", "p50_ms": "p50 ms", "p99_ms": "p99 ms",
                                  "mean_generated_tokens": "mean generated tokens"}),  # fmt: skip
        "",
        "p99 of a bucket with fewer than 100 requests is close to its maximum.",
        "",
    ]
    write_markdown(stem.with_suffix(".md"), lines, echo=False)
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
