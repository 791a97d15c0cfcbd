"""Step-level vs request-level batching of /translate under mixed source lengths; writes CSV + Markdown + PNG.

    python benchmarks/stepbatch.py [--bundle translate-linformer] [--users 1,16] [--seconds 20] [--rounds 2]

Each round starts one `python -m service` per scheduling (LINFORMER_TRANSLATE_SCHEDULING=step, then request,
the order alternating round by round), pinned to core 1 with one ORT thread, and runs closed loops of N
keep-alive clients against it from this process (pinned to core 0): each client sends one text at a time,
greedy, with the source lengths taken in turn from --lengths (each client starting at a different one) and
max_new_tokens = 2n + 8 as in loadtest/translate.py. Texts are held-out EN-DE test sources cut to exactly n
tokens (loadtest/texts.py; lengths the committed loadtest/data lacks need the prepared data, e.g.
LOADTEST_TRANSLATE_DATA=/path/to/.cache/data/ende/test.tsv). Generated tokens per text are read from one
warm-up answer per text (greedy output is deterministic, and identical under both schedulings: the tests
check it), so throughput = sum of the generated tokens of the answered requests / the run's seconds.
Short requests are those of <= 32 source tokens (the issue's goal: their p99 at 16 users <= 2x at 1 user).
This is not the issue's final benchmark (that is the CTranslate2 side-by-side); it checks the goals' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import Connection, Server, free_port, percentile, pin_to, post_request  # noqa: E402
from loadtest.report import header, load_average, markdown_table, write_csv  # noqa: E402
from loadtest.texts import texts_of_length, translate_max_new_tokens  # noqa: E402
from service.config import Settings  # noqa: E402

SHORT = 32  # source tokens: the "short requests"
SCHEDULINGS = ("step", "request")


def request_bodies(lengths: list[int]) -> list[tuple[int, bytes]]:
    """(source length, HTTP request) for every text of every length, lengths interleaved."""
    texts = {n: texts_of_length("translate", n) for n in lengths}
    bodies = []
    for i in range(max(map(len, texts.values()))):
        for n in lengths:
            text = texts[n][i % len(texts[n])]
            body = json.dumps({"text": text, "truncate": True, "max_new_tokens": translate_max_new_tokens(n)})
            bodies.append((n, body))
    return [(n, post_request("/translate", body.encode())) for n, body in bodies]


def generated_tokens(port: int, lengths: list[int]) -> list[int]:
    """One warm-up answer per body: the tokens each text generates."""
    counts = []
    for _, body in request_bodies(lengths):
        raw = body.split(b"\r\n\r\n", 1)[1]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=raw,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as response:
            counts.append(json.loads(response.read())["translations"][0]["tokens"])
    return counts


async def closed_loop(port: int, bodies: list[tuple[int, bytes]], clients: int, seconds: float) -> list[dict]:
    """N clients, each sending the next body in turn (client i starts at body i) when its last one is answered."""
    records: list[dict] = []
    started = time.perf_counter()

    async def client(index: int) -> None:
        conn, turn = None, index
        while time.perf_counter() - started < seconds:
            which = turn % len(bodies)
            n, request = bodies[which]
            sent = time.perf_counter()
            try:
                conn = conn or await Connection.open(port)
                status, closing = await conn.exchange(request)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                status, closing = 0, True
            records.append({"n": n, "body": which, "latency_s": time.perf_counter() - sent, "status": status})
            if closing and conn is not None:
                conn.close()
                conn = None
            turn += clients if clients > 1 else 1
        if conn is not None:
            conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return records


def summarise(scheduling: str, users: int, round_: int, records: list[dict], tokens: list[int], seconds: float):
    ok = [r for r in records if r["status"] == 200]
    short = [r["latency_s"] * 1000 for r in ok if r["n"] <= SHORT]
    longer = [r["latency_s"] * 1000 for r in ok if r["n"] > SHORT]
    return {
        "scheduling": scheduling, "users": users, "round": round_, "requests": len(ok),
        "errors": len(records) - len(ok),
        "tokens_per_s": sum(tokens[r["body"]] for r in ok) / seconds,
        "requests_per_s": len(ok) / seconds,
        "short_p50_ms": percentile(short, 50), "short_p99_ms": percentile(short, 99), "short_requests": len(short),
        "long_p50_ms": percentile(longer, 50), "long_p99_ms": percentile(longer, 99),
        "load_1min": os.getloadavg()[0],
    }  # fmt: skip


def pooled(rows: list[dict], scheduling: str, users: int, raw: dict) -> dict:
    """One row per (scheduling, users) over every round: throughput summed over the rounds' seconds,
    percentiles of all their requests together."""
    runs = [r for r in rows if r["scheduling"] == scheduling and r["users"] == users]
    records = [rec for key, recs in raw.items() if key[:2] == (scheduling, users) for rec in recs]
    short = [r["latency_s"] * 1000 for r in records if r["status"] == 200 and r["n"] <= SHORT]
    return {
        "scheduling": scheduling, "users": users, "rounds": len(runs),
        "tokens_per_s": sum(r["tokens_per_s"] for r in runs) / len(runs),
        "requests_per_s": sum(r["requests_per_s"] for r in runs) / len(runs),
        "short_p50_ms": percentile(short, 50), "short_p99_ms": percentile(short, 99), "short_requests": len(short),
        "errors": sum(r["errors"] for r in runs),
    }  # fmt: skip


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for scheduling in SCHEDULINGS:
        rows = [r for r in summary if r["scheduling"] == scheduling]
        users = [r["users"] for r in rows]
        left.plot(users, [r["tokens_per_s"] for r in rows], marker="o", label=scheduling)
        right.plot(users, [r["short_p99_ms"] for r in rows], marker="o", label=scheduling)
    left.set(xlabel="users (closed loop)", ylabel="generated tokens/s", title="throughput, mixed lengths")
    right.set(xlabel="users (closed loop)", ylabel="ms", title=f"p99 of short requests (<= {SHORT} tokens)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="translate-linformer")
    parser.add_argument("--lengths", default="8,16,32,64,128,256")
    parser.add_argument("--users", default="1,16")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--stem", default="stepbatch")
    parser.add_argument("--schedulings", default=",".join(SCHEDULINGS), help="for trial runs: e.g. only step")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    users = [int(u) for u in args.users.split(",")]
    load_before = load_average()
    bodies = request_bodies(lengths)
    rows, raw, tokens = [], {}, None
    for round_ in range(args.rounds):
        chosen = [s for s in SCHEDULINGS if s in args.schedulings.split(",")]
        order = chosen if round_ % 2 == 0 else chosen[::-1]
        for scheduling in order:
            env = {"LINFORMER_TRANSLATE_MODEL": args.bundle, "LINFORMER_CLASSIFY_MODEL": "",
                   "LINFORMER_TRANSLATE_SCHEDULING": scheduling, "LINFORMER_ORT_INTRA_OP_THREADS": "1",
                   "LINFORMER_ORT_INTER_OP_THREADS": "1", "LINFORMER_EXECUTION_PROVIDER": "cpu",
                   "LINFORMER_LOG_LEVEL": "warning"}  # fmt: skip
            server = Server(free_port(), env, cores="1")
            pin_to({0})
            try:
                counts = generated_tokens(server.port, lengths)
                if tokens is not None and counts != tokens:
                    raise SystemExit(f"{scheduling}: generated token counts differ from the other scheduling's")
                tokens = counts
                for n_users in users:
                    records = asyncio.run(closed_loop(server.port, bodies, n_users, args.seconds))
                    raw[(scheduling, n_users, round_)] = records
                    row = summarise(scheduling, n_users, round_, records, tokens, args.seconds)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                server.stop()
    if len(chosen) < len(SCHEDULINGS):
        return  # a trial: the per-run lines above are the result
    summary = [pooled(rows, s, u, raw) for s in SCHEDULINGS for u in users]
    by = {(r["scheduling"], r["users"]): r for r in summary}
    top = max(users)
    ratios = {f"throughput step / request at {top} users":
              by["step", top]["tokens_per_s"] / by["request", top]["tokens_per_s"]}  # fmt: skip
    for s in SCHEDULINGS:
        ratios[f"short p99 at {top} users / at {min(users)} user ({s})"] = (
            by[s, top]["short_p99_ms"] / by[s, min(users)]["short_p99_ms"]
        )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{args.stem}.csv", rows)
    plot(summary, args.out / f"{args.stem}.png")
    lines = header("/translate: step-level vs request-level batching, mixed source lengths",
                   ("onnxruntime", "fastapi", "uvicorn", "numpy"), load_before)  # fmt: skip
    lines += [
        f"Bundle {args.bundle}; source lengths {lengths} tokens in turn per client, greedy, max_new_tokens = 2n + 8; "
        f"{args.rounds} round(s) of {args.seconds:g} s per (scheduling, users), schedulings alternating in order; "
        "server pinned to core 1 with 1 ORT thread, this load generator on core 0; other settings at their "
        f"defaults (step: LINFORMER_TRANSLATE_STEP_ALL_EVERY={Settings().translate_step_all_every}). Texts: "
        f"LOADTEST_TRANSLATE_DATA={os.environ.get('LOADTEST_TRANSLATE_DATA', '(committed loadtest/data)')}. "
        f"Generated tokens per text (warm-up, same under both): {sum(tokens)} over {len(tokens)} texts.",
        "",
        *markdown_table(summary, {"scheduling": "scheduling", "users": "users", "rounds": "rounds",
                                  "tokens_per_s": "generated tokens/s", "requests_per_s": "requests/s",
                                  "short_p50_ms": f"short (<= {SHORT}) p50 ms", "short_p99_ms": "short p99 ms",
                                  "short_requests": "short requests", "errors": "errors"}),  # fmt: skip
        "",
        *[f"- {name}: **{value:.2f}x**" for name, value in ratios.items()],
        "",
        "Per round (load average at the end of each run in `load_1min`):",
        "",
        *markdown_table(rows, {"round": "round", "scheduling": "scheduling", "users": "users",
                               "tokens_per_s": "tokens/s", "short_p99_ms": "short p99 ms",
                               "long_p50_ms": "longer p50 ms", "long_p99_ms": "longer p99 ms", "errors": "errors",
                               "load_1min": "load (1 min)"}),  # fmt: skip
        "",
        f"![throughput and short-request p99]({args.stem}.png)",
    ]
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
