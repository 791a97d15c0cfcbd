"""Soak benchmark: 10 minutes at about 70 % of the saturated throughput; failures and memory growth.

    python -m benchmarks.soak [--minutes 10] [--fraction 0.7] [--bundle classify-linformer] [--out benchmarks/results]

The server (`python -m service`, default settings, 1 ORT thread) is pinned to core 0, this load generator to
core 1. Saturation is measured first (closed loop, 8 s at each of a few concurrencies, best throughput, in
`--saturation-rounds` rounds: their median, since this VM's speed drifts 25-40 % within minutes and one round in a fast
spell set a rate the server could not keep up with for most of the soak); then an open-loop rate of `fraction` x that
runs for `--minutes`, with the server's RSS sampled every 5 s. Goals
(issue #12): 0 failures (anything but 200), RSS growth < 5 % from the end of the first minute (warm-up) to the
end. After the soak, `--backlog-rounds` pairs of closed-loop phases, 16 clients and then 1,100 on /classify (its burst
limit and most of the waiting room: a standing backlog), 8 s each: whether a backlog is served slower than an unloaded
saturation on this machine, which would keep a backlog once formed. Each 5-s window also records the server's share of
core 0 and the hypervisor's (steal, from /proc/stat): whether a window that fell behind had less of the core. Writes
soak-<bundle>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import (  # noqa: E402
    bundle_task,
    closed_loop,
    one_text_request,
    open_loop,
    peak_outstanding,
    percentile,
    server_on_core_0,
)  # fmt: skip
from benchmarks.overload import SATURATING, WHAT_IS_SENT, best, saturation_run  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service.config import Settings  # noqa: E402

SAMPLE_S = 5.0
WARM_UP_S = 60.0


def core_0_steal_s() -> float:
    """Seconds the hypervisor ran something else while core 0 (the server's) wanted to run: /proc/stat's steal."""
    fields = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("cpu0 ")).split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def backlog_clients(task: str) -> tuple[int, int]:
    """Closed-loop clients that keep a backlog standing on a task's route without a refusal: its default burst limit
    and most of the default waiting room (1,100 for /classify's 128 + 1,024); -> (clients, burst limit)."""
    defaults = Settings.model_construct()
    burst, _ = defaults.route_limits(task)
    return burst + defaults.max_waiting_requests - 52, burst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="classify-linformer")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fraction", type=float, default=0.7)
    parser.add_argument("--saturation-rounds", type=int, default=3, help="saturation = the median of their bests")
    parser.add_argument("--setting", action="append", default=[], help="extra LINFORMER_X=value for the server")
    parser.add_argument("--backlog-rounds", type=int, default=2, help="after the soak: 16 vs ~1,100 clients, pairs")
    parser.add_argument("--stem", help="results file name (default soak-<bundle>)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    if args.minutes * 60 <= 2 * WARM_UP_S:
        parser.error(f"--minutes must leave time after the {WARM_UP_S:g}-s warm-up to measure RSS growth over")
    load_before = load_average()
    server = server_on_core_0(args.bundle, args.setting)
    port = server.port
    task = bundle_task(args.bundle)
    request = one_text_request(task)
    seconds = args.minutes * 60
    rss: list[tuple[float, float]] = []
    loads: list[tuple[float, float]] = []
    cpu: list[tuple[float, float, float]] = []  # (t, server CPU seconds, core 0's steal seconds)
    try:
        asyncio.run(closed_loop(port, request, 8, 3.0))  # warm-up
        concurrencies = list(map(int, SATURATING[task].split(",")))
        rounds = [saturation_run(server, request, concurrencies, f"round {n + 1}")
                  for n in range(args.saturation_rounds)]  # fmt: skip
        saturation = [row for phase in rounds for row in phase]
        saturated_rps = statistics.median(best(phase)["throughput_rps"] for phase in rounds)
        rate = args.fraction * saturated_rps

        async def run() -> list:
            started = time.perf_counter()

            async def sample() -> None:
                while True:
                    rss.append((time.perf_counter() - started, server.rss_mb()))
                    loads.append((time.perf_counter() - started, os.getloadavg()[0]))
                    cpu.append((time.perf_counter() - started, sum(server.cpu_s()), core_0_steal_s()))
                    await asyncio.sleep(SAMPLE_S)

            sampler = asyncio.create_task(sample())
            try:
                return await open_loop(port, request, [(seconds, rate)], started=started)
            finally:
                sampler.cancel()

        records = asyncio.run(run())
        rss.append((seconds, server.rss_mb()))
        backlog = []
        for n in range(args.backlog_rounds):
            backlog += saturation_run(server, request, [16, backlog_clients(task)[0]], f"round {n + 1}")
    finally:
        exit_code = server.stop()
    rows = []
    peaks = peak_outstanding(records, SAMPLE_S)
    for i in range(int(seconds / SAMPLE_S)):
        lo, hi = i * SAMPLE_S, (i + 1) * SAMPLE_S
        inside = [r for r in records if lo <= r.due_s < hi]
        ok = [r.latency_s for r in inside if r.status == 200]
        rss_now = next((mb for t, mb in rss if t >= lo), rss[-1][1])
        load_now = next((la for t, la in loads if t >= lo), loads[-1][1] if loads else None)
        # the server's and the hypervisor's shares of core 0 from this window's sample to the next
        first, then = next(((a, b) for a, b in zip(cpu, cpu[1:], strict=False) if a[0] >= lo), (None, None))
        shares = ((then[1] - first[1]) / (then[0] - first[0]), (then[2] - first[2]) / (then[0] - first[0])) \
            if first else (None, None)
        rows.append({"t_s": lo, "ok_rps": len(ok) / SAMPLE_S, "failures": len(inside) - len(ok),
                     "p50_ms": percentile(ok, 50) * 1000 if ok else None,
                     "p99_ms": percentile(ok, 99) * 1000 if ok else None, "rss_mb": rss_now,
                     "load_average_1min": load_now, "server_cpu_share": shares[0], "core_0_steal_share": shares[1],
                     "peak_in_flight": peaks.get(i, 0),
                     "generator_lag_max_ms": max((r.lag_s for r in inside), default=0) * 1000})  # fmt: skip
    failures = sum(r.status != 200 for r in records)
    statuses = sorted({r.status for r in records if r.status != 200})
    rss_warm = next(mb for t, mb in rss if t >= WARM_UP_S)
    rss_end = rss[-1][1]
    growth = (rss_end - rss_warm) / rss_warm
    ok = [r.latency_s for r in records if r.status == 200]
    lags = [r.lag_s for r in records]
    worst = max(rows, key=lambda row: row["peak_in_flight"])
    stem = args.stem or f"soak-{args.bundle}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", rows)
    if backlog:
        write_csv(args.out / f"{stem}-backlog.csv", backlog)
    plot(rows, args.out / f"{stem}.png", rate, f"{args.bundle}: {rate:.0f} req/s open loop for {args.minutes:g} min")
    lines = header(f"Soak: {args.bundle}, {args.minutes:g} minutes at {args.fraction:.0%} of saturation",
                   ("onnxruntime", "fastapi", "uvicorn"), load_before)  # fmt: skip
    lines += [
        "Server: `python -m service` pinned to core 0, 1 ORT thread, default settings except "
        f"{', '.join(f'`{k}={v}`' for k, v in server.env.items())}. Load generator: raw asyncio "
        f"HTTP/1.1 client on core 1, open loop, {WHAT_IS_SENT[task]} per request. The machine is shared with "
        "other jobs; the 1-minute load average is in the CSV for every 5-s window.",
        "",
        *markdown_table(saturation, {"when": "round", "clients": "closed-loop clients", "throughput_rps": "200/s"}),
        "",
        f"Saturated throughput (the median of the rounds' best) {saturated_rps:.0f} req/s; soak rate {rate:.0f} req/s "
        f"for {seconds:g} s: "
        f"{len(records)} requests, p50 / p99 {percentile(ok, 50) * 1000:.1f} / {percentile(ok, 99) * 1000:.1f} ms.",
        "",
        f"Requests in flight (sent, not answered), the figure admission compares with its limit: at most "
        f"{worst['peak_in_flight']} (in the window at {worst['t_s']:g} s); median of the per-window peaks "
        f"{percentile([row['peak_in_flight'] for row in rows], 50):.0f}. The generator's own delay in sending: p99 "
        f"{percentile(lags, 99) * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms (per window in the CSV).",
        "",
        *core_0_lines(rows),
        "| goal | measured | target | met |",
        "|---|---|---|---|",
        f"| failures (not 200) | {failures}{' (statuses ' + ', '.join(map(str, statuses)) + ')' if statuses else ''}"
        f" | 0 | {'yes' if failures == 0 else '**no**'} |",
        f"| RSS growth after warm-up ({rss_warm:.1f} MB at {WARM_UP_S:g} s -> {rss_end:.1f} MB at the end) | "
        f"{growth:+.2%} | < 5 % | {'yes' if growth < 0.05 else '**no**'} |",
        "",
        f"Server exit code on SIGTERM: {exit_code}. RSS at start of the soak: {rss[0][1]:.1f} MB.",
        "",
        *backlog_section(backlog, task, rate),
        f"![throughput, latency and RSS over time]({stem}.png)",
        "",
    ]  # fmt: skip
    write_markdown(args.out / f"{stem}.md", lines)


def core_0_lines(rows: list[dict]) -> list[str]:
    """Whether the windows that fell behind had less of the core: the server's CPU share and the hypervisor's steal
    of core 0 (/proc/stat), median over the windows with a failure or over 100 in flight, and over the others."""
    def medians(group: list[dict]) -> str:
        server = [row["server_cpu_share"] for row in group if row["server_cpu_share"] is not None]
        steal = [row["core_0_steal_share"] for row in group if row["core_0_steal_share"] is not None]
        if not server:
            return "no sample"
        return (f"the server's CPU {percentile(server, 50):.2f} of core 0, steal {percentile(steal, 50):.3f} "
                f"(max {max(steal):.3f}) in {len(group)} windows")
    behind = [row for row in rows if row["failures"] or row["peak_in_flight"] > 100]
    others = [row for row in rows if row not in behind]
    return [f"Core 0 per 5-s window (medians; the CSV has each): behind (a failure or over 100 in flight): "
            f"{medians(behind) if behind else 'none'}; the others: {medians(others) if others else 'none'}.", ""]


def backlog_section(rows: list[dict], task: str, rate: float) -> list[str]:
    """Is a standing backlog served slower than an unloaded saturation (then a backlog, once formed, would stay)?"""
    if not rows:
        return []
    backlog, burst = backlog_clients(task)
    for row in rows:
        row["loop_us_per_request"] = row["loop_share"] / row["throughput_rps"] * 1e6
    rates = {clients: [row["throughput_rps"] for row in rows if row["clients"] == clients]
             for clients in (16, backlog)}  # fmt: skip
    return [
        "## A backlog against an unloaded saturation", "",
        f"After the soak, closed-loop phases of 8 s taking turns: 16 clients, then {backlog} ({burst} in progress, "
        "the rest in the waiting room: a standing backlog, no refusal).", "",
        *markdown_table(rows, {"when": "round", "clients": "clients", "throughput_rps": "200/s", "p99_ms": "p99 (ms)",
                               "rejected_429": "429", "loop_share": "event loop's share of the core",
                               "other_share": "compute threads' share",
                               "loop_us_per_request": "event-loop CPU per request (µs)"}),  # fmt: skip
        "",
        f"200/s with a backlog: {', '.join(f'{r:.0f}' for r in rates[backlog])}; with 16 clients: "
        f"{', '.join(f'{r:.0f}' for r in rates[16])} (the soak's rate was {rate / max(rates[16]):.2f} of the best of "
        "these).",
        "",
    ]


def plot(rows: list[dict], path: Path, rate: float, title: str) -> None:
    t = [row["t_s"] for row in rows]
    fig, (top, middle, bottom) = agg_subplots(3, 1, figsize=(9, 7.5), sharex=True)
    top.plot(t, [row["ok_rps"] for row in rows], color="tab:green", label="200/s")
    top.axhline(rate, ls="--", color="black", lw=0.8, label="offered")
    top.set_ylabel("requests / s")
    top.legend(fontsize=7)
    middle.plot(t, [row["p99_ms"] for row in rows], color="tab:red", label="p99")
    middle.plot(t, [row["p50_ms"] for row in rows], color="tab:blue", label="p50", lw=1)
    middle.set_ylabel("latency (ms)")
    middle.legend(fontsize=7, loc="upper left")
    in_flight = middle.twinx()
    in_flight.plot(t, [row["peak_in_flight"] for row in rows], color="grey", lw=0.8, label="peak in flight")
    in_flight.set_ylabel("requests in flight (peak)")
    in_flight.legend(fontsize=7, loc="upper right")
    bottom.plot(t, [row["rss_mb"] for row in rows], color="tab:purple")
    bottom.axvline(WARM_UP_S, ls=":", color="black", lw=0.8)
    bottom.set_ylabel("server RSS (MB)")
    bottom.set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
