"""Overload benchmark: does the service keep serving under a flood at 3x its saturated throughput?

    python -m benchmarks.overload [--bundle classify-linformer] [--seconds 20] [--factor 3] [--setting K=V]

The server (`python -m service`, default settings, 1 ORT thread) is pinned to core 0 with `taskset`; this
load generator pins itself to core 1. Steps:
1. Unloaded saturation: closed-loop keep-alive clients at a few concurrencies; the best throughput is the
   saturated throughput, and the p99 at that concurrency the unloaded p99.
2. Flood: an open-loop arrival rate of `factor` x the saturated throughput for `--seconds`, then half the
   saturated rate for 10 s (the recovery phase). Goodput is 200s per second during the flood; recovery is the
   time from the end of the flood until every later 250 ms window has no 429 and a p99 within 3x the unloaded
   p99.
3. Unloaded saturation again: the saturated throughput moves from minute to minute on a shared machine, so
   goodput is divided by the mean of the figures before and after the flood (both reported).
Goals (issue #12): goodput >= 90 % of saturated throughput, accepted p99 <= 3x unloaded p99 (before the flood),
0 5xx, recovery < 2 s. Writes overload-<bundle>.{csv,md,png}: the summary and throughput/latency over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import (  # noqa: E402
    REVIEW,
    Record,
    classify_server_on_core_0,
    closed_loop,
    open_loop,
    percentile,
    post_request,
)  # fmt: skip
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)

WINDOW_S = 0.25


def summarise(records: list[Record], seconds: float) -> dict:
    ok = [r.latency_s for r in records if r.status == 200]
    return {
        "requests": len(records), "ok": len(ok), "throughput_rps": len(ok) / seconds,
        "p50_ms": percentile(ok, 50) * 1000, "p99_ms": percentile(ok, 99) * 1000,
        "rejected_429": sum(r.status == 429 for r in records),
        "errors_5xx": sum(r.status >= 500 for r in records), "transport_errors": sum(r.status == 0 for r in records),
        "generator_lag_p99_ms": percentile([r.lag_s for r in records], 99) * 1000,
    }  # fmt: skip


def windows(records: list[Record], total_s: float) -> list[dict]:
    rows = []
    for i in range(int(total_s / WINDOW_S) + 1):
        lo, hi = i * WINDOW_S, (i + 1) * WINDOW_S
        inside = [r for r in records if lo <= r.due_s < hi]
        ok = [r.latency_s for r in inside if r.status == 200]
        rows.append({
            "t_s": round(lo, 3), "offered_rps": len(inside) / WINDOW_S, "ok_rps": len(ok) / WINDOW_S,
            "rejected_rps": sum(r.status == 429 for r in inside) / WINDOW_S,
            "errors_5xx": sum(r.status >= 500 for r in inside), "transport_errors": sum(r.status == 0 for r in inside),
            "p50_ms": percentile(ok, 50) * 1000 if ok else None, "p99_ms": percentile(ok, 99) * 1000 if ok else None,
        })  # fmt: skip
    return rows


def recovery_s(rows: list[dict], flood_end_s: float, p99_limit_ms: float, end_s: float) -> float | None:
    """Seconds after the flood until every later window is clean (no 429, p99 within the limit)."""
    after = [row for row in rows if flood_end_s <= row["t_s"] < end_s - WINDOW_S]
    for i, row in enumerate(after):
        if all(w["rejected_rps"] == 0 and (w["p99_ms"] or 0) <= p99_limit_ms for w in after[i:]):
            return row["t_s"] - flood_end_s
    return None


def saturation_run(port: int, request: bytes, concurrencies: list[int], when: str) -> list[dict]:
    """Closed-loop keep-alive clients at each concurrency, 8 s each: the unloaded saturated throughput and p99."""
    rows = []
    for clients in concurrencies:
        seconds = 8.0
        summary = summarise(asyncio.run(closed_loop(port, request, clients, seconds)), seconds)
        rows.append({"when": when, "clients": clients, **summary})
        print(f"closed loop {when} the flood, {clients} clients: {summary}", flush=True)
    return rows


def best(saturation: list[dict]) -> dict:
    return max(saturation, key=lambda row: row["throughput_rps"])


def plot(rows: list[dict], flood: tuple[float, float], saturated_rps: float, unloaded_p99_ms: float, path: Path,
         title: str) -> None:  # fmt: skip
    t = [row["t_s"] for row in rows]
    fig, (top, bottom) = agg_subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.plot(t, [row["offered_rps"] for row in rows], label="offered", color="grey", lw=1)
    top.plot(t, [row["ok_rps"] for row in rows], label="200 (goodput)", color="tab:green")
    top.plot(t, [row["rejected_rps"] for row in rows], label="429", color="tab:orange", lw=1)
    top.axhline(saturated_rps, ls="--", color="black", lw=0.8, label="unloaded saturated throughput (mean)")
    top.axhline(0.9 * saturated_rps, ls=":", color="black", lw=0.8, label="90 % of it")
    top.set_ylabel("requests / s")
    top.legend(fontsize=7, loc="upper right")
    bottom.plot(t, [row["p99_ms"] for row in rows], label="p99 of 200s", color="tab:red")
    bottom.plot(t, [row["p50_ms"] for row in rows], label="p50 of 200s", color="tab:blue", lw=1)
    bottom.axhline(3 * unloaded_p99_ms, ls="--", color="black", lw=0.8, label="3x unloaded p99")
    bottom.set_ylabel("latency (ms)")
    bottom.set_xlabel(f"seconds ({WINDOW_S:g} s windows)")
    bottom.legend(fontsize=7, loc="upper right")
    for axis in (top, bottom):
        axis.axvspan(*flood, color="tab:orange", alpha=0.08)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="classify-linformer")
    parser.add_argument("--seconds", type=float, default=20.0, help="flood duration")
    parser.add_argument("--factor", type=float, default=3.0, help="flood rate / saturated throughput")
    # around the ~8 in flight at which one core saturates: the best of these is the unloaded saturated throughput and
    # its p99 the unloaded p99 (with 32 or 64 clients the p99 only measures queueing, and 3x of it is no bound)
    parser.add_argument("--concurrencies", default="4,8,16", help="closed-loop clients for the saturation run")
    parser.add_argument("--setting", action="append", default=[], help="extra LINFORMER_X=value for the server")
    parser.add_argument("--stem", help="results file name (default overload-<bundle>)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    server = classify_server_on_core_0(args.bundle, args.setting)
    port = server.port
    request = post_request("/classify", json.dumps({"text": REVIEW}).encode())
    concurrencies = [int(clients) for clients in args.concurrencies.split(",")]
    try:
        asyncio.run(closed_loop(port, request, 8, 3.0))  # warm-up
        before = saturation_run(port, request, concurrencies, "before")
        flood_rate = args.factor * best(before)["throughput_rps"]
        recovery_phase_s = 10.0
        rss_before = server.rss_mb()
        records = asyncio.run(open_loop(
            port, request, [(args.seconds, flood_rate), (recovery_phase_s, 0.5 * best(before)["throughput_rps"])]))
        rss_after = server.rss_mb()
        after = saturation_run(port, request, concurrencies, "after")
    finally:
        exit_code = server.stop()
    # The saturated throughput moves by as much as the effect measured on this shared VM (1,674-2,119 req/s within a
    # quarter hour), so it is measured before and after the flood and the goodput is divided by their mean.
    saturated_rps = (best(before)["throughput_rps"] + best(after)["throughput_rps"]) / 2
    unloaded_p99 = best(before)["p99_ms"]
    total = args.seconds + recovery_phase_s
    flood_records = [r for r in records if r.due_s < args.seconds]
    flood = summarise(flood_records, args.seconds)
    rows = windows(records, total)
    recovery = recovery_s(rows, args.seconds, 3 * unloaded_p99, total)
    goodput = flood["throughput_rps"] / saturated_rps
    goals = [
        ("goodput during the flood / saturated throughput (mean of before and after)", goodput, ">= 0.90",
         goodput >= 0.9),
        ("p99 of accepted during the flood / unloaded p99 (before)", flood["p99_ms"] / unloaded_p99, "<= 3",
         flood["p99_ms"] / unloaded_p99 <= 3),
        ("5xx and transport errors", float(flood["errors_5xx"] + flood["transport_errors"]
                                           + sum(r.status == 0 or r.status >= 500 for r in records)), "0",
         not any(r.status == 0 or r.status >= 500 for r in records)),
        ("recovery after the flood (s)", recovery, "< 2", recovery is not None and recovery < 2),
    ]  # fmt: skip
    stem = args.stem or f"overload-{args.bundle}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", rows)
    plot(rows, (0, args.seconds), saturated_rps, unloaded_p99, args.out / f"{stem}.png",
         f"{args.bundle}: {args.factor:g}x flood ({flood_rate:.0f} req/s open loop) for {args.seconds:g} s, "
         f"then {0.5 * best(before)['throughput_rps']:.0f} req/s")  # fmt: skip
    lines = header(f"Overload: {args.bundle} under a {args.factor:g}x flood", ("onnxruntime", "fastapi", "uvicorn"),
                   load_before)  # fmt: skip
    lines += [
        "Server: `python -m service` pinned to core 0 (`taskset -c 0`), 1 ORT thread, settings at their defaults "
        f"except {', '.join(f'`{k}={v}`' for k, v in server.env.items())}. Load generator: this script's raw asyncio "
        "HTTP/1.1 client pinned to core 1, one ~50-token review per request. The machine is shared with other "
        "jobs (load average above), so absolute rates move from run to run; the ratios compare figures from "
        "this one run.",
        "",
        "## Unloaded saturation (closed loop, 8 s each), before and after the flood",
        "",
        *markdown_table(before + after, {"when": "when", "clients": "clients", "throughput_rps": "200/s",
                                         "p50_ms": "p50 ms", "p99_ms": "p99 ms", "rejected_429": "429",
                                         "errors_5xx": "5xx"}),
        "",
        f"Saturated throughput {best(before)['throughput_rps']:.0f} req/s before the flood "
        f"({best(before)['clients']} clients, p99 {unloaded_p99:.1f} ms: the unloaded p99), "
        f"{best(after)['throughput_rps']:.0f} req/s after it ({best(after)['clients']} clients, p99 "
        f"{best(after)['p99_ms']:.1f} ms); their mean, {saturated_rps:.0f} req/s, is what goodput is divided by "
        f"(against the figure before alone: {flood['throughput_rps'] / best(before)['throughput_rps']:.3f}, after "
        f"alone: {flood['throughput_rps'] / best(after)['throughput_rps']:.3f}).",
        "",
        f"## Flood: {flood_rate:.0f} req/s open loop for {args.seconds:g} s, then "
        f"{0.5 * best(before)['throughput_rps']:.0f} req/s "
        f"for {recovery_phase_s:g} s",
        "",
        f"During the flood: {flood['requests']} requests, {flood['ok']} answered 200 ({flood['throughput_rps']:.0f}/s),"
        f" {flood['rejected_429']} refused with 429, {flood['errors_5xx']} 5xx, {flood['transport_errors']} "
        f"transport errors; p50 / p99 of the 200s {flood['p50_ms']:.1f} / {flood['p99_ms']:.1f} ms (the "
        f"generator's own delay in sending, p99: {flood['generator_lag_p99_ms']:.1f} ms). Server RSS "
        f"{rss_before:.0f} MB before, {rss_after:.0f} MB after; exit code on SIGTERM {exit_code}.",
        "",
        "| goal | measured | target | met |",
        "|---|---|---|---|",
        *[f"| {name} | {'–' if value is None else f'{value:.3g}'} | {target} | {'yes' if met else '**no**'} |"
          for name, value, target, met in goals],
        "",
        f"![throughput and latency over time]({stem}.png)",
        "",
        f"Per-window figures ({WINDOW_S:g} s, by when each request was due): [`{stem}.csv`]({stem}.csv).",
        "",
    ]  # fmt: skip
    write_markdown(args.out / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
