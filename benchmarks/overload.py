"""Overload benchmark: does the service keep serving under a flood at 3x its saturated throughput?

    python -m benchmarks.overload [--bundle classify-linformer] [--seconds 20] [--rounds 3] [--factor 3]
                                  [--setting K=V]

The server (`python -m service`, default settings, 1 ORT thread) is pinned to core 0 with `taskset`; this
load generator pins itself to core 1. Steps:
1. Unloaded saturation: closed-loop keep-alive clients at a few concurrencies; the best throughput is the
   saturated throughput, and the p99 at that concurrency the unloaded p99.
2. Rounds: a flood, an open-loop arrival rate of `factor` x the first saturated throughput for `--seconds`, then
   half that saturated rate for 10 s (the calm phase), then unloaded saturation again. Goodput is 200s per second
   during the flood; recovery is the time from the end of the flood until every later 250 ms window of the calm
   phase has no 429 and a p99 within 3x the unloaded p99.
A shared core's speed drifts by as much as the effect measured (the model alone: 22 % within seconds on some VMs),
so each round's goodput is divided by the mean saturated throughput of the phases right before and after it, and
the rounds are averaged.
Goals (issue #12): goodput >= 90 % of saturated throughput (mean over rounds), accepted p99 <= 3x unloaded p99
(the phase before; every round), 0 5xx, recovery < 2 s (every round). Writes overload-<bundle>.{csv,md,png}: the
summary and throughput/latency over time.

`--storm N`: the flood is N closed-loop keep-alive clients instead, each sending its next request the moment it
is answered, 429 or not (a client that ignores Retry-After, as wrk does, or a retry loop without a pause): the
refusals come as fast as the server writes them. Writes overload-storm-<bundle>.*.

`--alternate K=V[,K=V...]`: an A/B of settings under the flood. Two servers run on core 0, the second with these
settings added; the flood goes to one at a time in `--segments` segments of `--seconds` each (A B B A A B ...: a
drift of the core's speed falls on both), the other idling meanwhile. Each segment's 200s per second after its
first second (connections opened, shedding engaged), the event loop's share of the core and its wake-ups (context
switches of its thread); closed-loop saturation of each (`--concurrencies`), before and after. A difference
smaller than a whole run's spread shows here, where separate runs minutes apart cannot tell it. Writes
overload-alternate-<bundle>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import (  # noqa: E402
    Record,
    Server,
    bundle_task,
    closed_loop,
    one_text_request,
    open_loop,
    percentile,
    server_on_core_0,
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
SATURATING = {"classify": "4,8,16", "translate": "4,8,16,32"}  # --concurrencies' defaults (main)
WHAT_IS_SENT = {"classify": "one ~50-token review (`loadgen.REVIEW`) to /classify",
                "translate": "one 14-token sentence (`loadgen.SENTENCE`) to /translate, greedy"}
CALM_PHASE_S = 10.0  # after each flood, half the saturated rate: does the service recover?


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


def core_shares(server: Server, before: tuple[float, float, float]) -> dict:
    """The server's share of its core since `before` (= `cpu_mark(server)`): event-loop thread, other threads."""
    loop, other, wall = cpu_mark(server)
    elapsed = wall - before[2]
    return {"loop_share": (loop - before[0]) / elapsed, "other_share": (other - before[1]) / elapsed}


def cpu_mark(server: Server) -> tuple[float, float, float]:
    return (*server.cpu_s(), time.perf_counter())


def saturation_run(server: Server, request: bytes, concurrencies: list[int], when: str) -> list[dict]:
    """Closed-loop keep-alive clients at each concurrency, 8 s each: the unloaded saturated throughput and p99."""
    rows = []
    for clients in concurrencies:
        seconds = 8.0
        mark = cpu_mark(server)
        summary = summarise(asyncio.run(closed_loop(server.port, request, clients, seconds)), seconds)
        rows.append({"when": when, "clients": clients, **summary, **core_shares(server, mark)})
        print(f"closed loop ({when}), {clients} clients: {summary}", flush=True)
    return rows


def best(saturation: list[dict]) -> dict:
    return max(saturation, key=lambda row: row["throughput_rps"])


async def flood_round(server: Server, request: bytes, phases: list[tuple[float, float]],
                      storm: int = 0) -> tuple[list[Record], dict]:  # fmt: skip
    """The open-loop phases, and the server's core shares during the first (the flood; with `storm`, that many
    closed-loop clients instead, the open loop sending nothing meanwhile)."""
    started = time.perf_counter()
    load = asyncio.create_task(open_loop(server.port, request, [(phases[0][0], 0.0), *phases[1:]] if storm
                                         else phases, started=started))  # fmt: skip
    mark = cpu_mark(server)
    stormed = await closed_loop(server.port, request, storm, phases[0][0], started) if storm else []
    await asyncio.sleep(max(0.0, started + phases[0][0] - time.perf_counter()))
    shares = core_shares(server, mark)
    return stormed + await load, shares


def judge_round(number: int, flood: tuple[list[Record], dict], before: list[dict], after: list[dict],
                seconds: float) -> dict:  # fmt: skip
    """One flood and its calm phase (`flood_round`'s records and core shares), against the saturation phases right
    before and after it."""
    records, shares = flood
    saturated_rps = (best(before)["throughput_rps"] + best(after)["throughput_rps"]) / 2
    unloaded_p99 = best(before)["p99_ms"]
    flooded = summarise([r for r in records if r.due_s < seconds], seconds)
    rows = windows(records, seconds + CALM_PHASE_S)
    failures = sum(r.status == 0 or r.status >= 500 for r in records)
    return {
        "round": number, "saturated_before_rps": best(before)["throughput_rps"],
        "saturated_after_rps": best(after)["throughput_rps"], "saturated_rps": saturated_rps,
        "ok_rps": flooded["throughput_rps"], "goodput": flooded["throughput_rps"] / saturated_rps,
        "requests": flooded["requests"], "rejected_429": flooded["rejected_429"], "failures": failures,
        "p50_ms": flooded["p50_ms"], "p99_ms": flooded["p99_ms"], "unloaded_p99_ms": unloaded_p99,
        "p99_ratio": flooded["p99_ms"] / unloaded_p99, "lag_p99_ms": flooded["generator_lag_p99_ms"],
        "recovery_s": recovery_s(rows, seconds, 3 * unloaded_p99, seconds + CALM_PHASE_S), **shares,
        "loop_share_unloaded": best(before)["loop_share"], "windows": rows,
    }  # fmt: skip


def plot(rounds: list[dict], seconds: float, path: Path, title: str) -> None:
    fig, (top, bottom) = agg_subplots(2, 1, figsize=(9, 6.5), sharex=True)
    span = seconds + CALM_PHASE_S
    for i, judged in enumerate(rounds):
        start = i * span
        rows, first = judged["windows"], i == 0
        t = [start + row["t_s"] for row in rows]
        top.plot(t, [row["offered_rps"] for row in rows], color="grey", lw=1, label="offered" if first else None)
        top.plot(t, [row["ok_rps"] for row in rows], color="tab:green", label="200 (goodput)" if first else None)
        top.plot(t, [row["rejected_rps"] for row in rows], color="tab:orange", lw=1, label="429" if first else None)
        saturated = judged["saturated_rps"]
        label = "unloaded saturated throughput (mean of the phases around the round)" if first else None
        top.hlines(saturated, start, start + span, ls="--", color="black", lw=0.8, label=label)
        top.hlines(0.9 * saturated, start, start + span, ls=":", color="black", lw=0.8,
                   label="90 % of it" if first else None)  # fmt: skip
        bottom.plot(t, [row["p99_ms"] for row in rows], color="tab:red", label="p99 of 200s" if first else None)
        bottom.plot(t, [row["p50_ms"] for row in rows], color="tab:blue", lw=1, label="p50 of 200s" if first else None)
        bottom.hlines(3 * judged["unloaded_p99_ms"], start, start + span, ls="--", color="black", lw=0.8,
                      label="3x unloaded p99" if first else None)  # fmt: skip
        for axis in (top, bottom):
            axis.axvspan(start, start + seconds, color="tab:orange", alpha=0.08)
            if i:
                axis.axvline(start, color="black", lw=0.5)
    top.set_ylabel("requests / s")
    top.legend(fontsize=7, loc="upper right")
    bottom.set_ylabel("latency (ms)")
    bottom.set_xlabel(f"seconds of open-loop load, rounds one after the other ({WINDOW_S:g} s windows; "
                      "the saturation phases between rounds left out)")
    bottom.legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)


def loop_switches(server: Server) -> int:
    """Context switches of the server's event-loop thread so far (each wake-up is one, and so is each preemption)."""
    status = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/status").read_text()
    return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)


def alternate(args: argparse.Namespace, task: str, load_before: str) -> None:
    """`--alternate`: see the module's docstring."""
    extra = args.alternate.split(",")
    servers = {"A": server_on_core_0(args.bundle, args.setting),
               "B": server_on_core_0(args.bundle, args.setting + extra)}
    names = {"A": "as set" + (f" ({', '.join(args.setting)})" if args.setting else " (defaults)"),
             "B": f"with {', '.join(extra)}"}
    request = one_text_request(task)
    concurrencies = [int(clients) for clients in (args.concurrencies or SATURATING[task]).split(",")]
    saturations: list[dict] = []
    segments: list[dict] = []
    try:
        for server in servers.values():
            asyncio.run(closed_loop(server.port, request, 8, 3.0))  # warm-up
        for label, server in servers.items():
            rows = saturation_run(server, request, concurrencies, "before")
            saturations += [{"server": label, **row} for row in rows]
        flood_rate = args.factor * max(row["throughput_rps"] for row in saturations if row["server"] == "A")
        for i in range(args.segments):
            label = "AB"[(i + i // 2) % 2]  # A B B A A B B A ...
            server = servers[label]
            switches = loop_switches(server)
            records, shares = asyncio.run(flood_round(server, request, [(args.seconds, flood_rate)]))
            measured = summarise([r for r in records if r.due_s >= 1.0], args.seconds - 1.0)
            segments.append({"segment": i + 1, "server": label, "ok_rps": measured["throughput_rps"],
                             "p99_ms": measured["p99_ms"], "rejected_429": measured["rejected_429"],
                             "failures": measured["errors_5xx"] + measured["transport_errors"],
                             "loop_wakeups_per_s": (loop_switches(server) - switches) / args.seconds,
                             "lag_p99_ms": measured["generator_lag_p99_ms"], **shares})  # fmt: skip
            print(f"segment {i + 1} ({label}): {segments[-1]}", flush=True)
        for label, server in reversed(servers.items()):
            saturations += [{"server": label, **row} for row in saturation_run(server, request, concurrencies, "after")]
    finally:
        exit_codes = {label: server.stop() for label, server in servers.items()}
    summary = []
    for label in servers:
        mine = [row for row in segments if row["server"] == label]
        saturated = statistics.mean(max(row["throughput_rps"] for row in saturations
                                        if row["server"] == label and row["when"] == when)
                                    for when in ("before", "after"))  # fmt: skip
        ok = statistics.median(row["ok_rps"] for row in mine)
        summary.append({"server": f"{label}: {names[label]}", "saturated_rps": saturated, "ok_rps": ok,
                        "goodput": ok / saturated, "p99_ms": statistics.median(row["p99_ms"] for row in mine),
                        "loop_share": statistics.median(row["loop_share"] for row in mine),
                        "loop_wakeups_per_s": statistics.median(row["loop_wakeups_per_s"] for row in mine),
                        "failures": sum(row["failures"] for row in mine)})  # fmt: skip
    # pairs: segments 2k+1 and 2k+2 hold one of each (A B, B A, ...)
    by_server = [{row["server"]: row["ok_rps"] for row in segments[i : i + 2]} for i in range(0, len(segments) - 1, 2)]
    pairs = [pair["B"] / pair["A"] for pair in by_server]
    stem = args.stem or f"overload-alternate-{args.bundle}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", segments + saturations)
    fig, (top, bottom) = agg_subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, color in (("A", "tab:blue"), ("B", "tab:green")):
        mine = [row for row in segments if row["server"] == label]
        x = [row["segment"] for row in mine]
        top.bar(x, [row["ok_rps"] for row in mine], color=color, label=f"{label}: {names[label]}")
        bottom.bar(x, [row["loop_wakeups_per_s"] for row in mine], color=color)
    top.set_ylabel("200s / s in the flood")
    top.set_ylim(0.6 * min(row["ok_rps"] for row in segments), 1.2 * max(row["ok_rps"] for row in segments))
    top.legend(fontsize=7, loc="upper center", ncol=2)
    bottom.set_ylabel("event-loop wake-ups / s")
    bottom.set_xlabel(f"segment ({args.seconds:g} s each, the flood at {flood_rate:.0f} req/s)")
    fig.suptitle(f"{args.bundle}: a {args.factor:g}x flood alternating between two servers", fontsize=10)
    save_figure(fig, args.out / f"{stem}.png", dpi=110)
    lines = header(f"Overload A/B: {args.bundle} under a {args.factor:g}x flood, {names['B']}",
                   ("onnxruntime", "fastapi", "uvicorn"), load_before)  # fmt: skip
    lines += [
        f"Two servers (`python -m service`, 1 ORT thread, log level warning) pinned to core 0, **A** {names['A']}, "
        f"**B** {names['B']}; the load generator (this script's asyncio HTTP/1.1 client, {WHAT_IS_SENT[task]}) on "
        f"core 1. An open-loop flood at {flood_rate:.0f} req/s ({args.factor:g}x A's best closed-loop throughput) "
        f"in {args.segments} segments of {args.seconds:g} s, to A and B in turn (A B B A ...), the other idle; each "
        f"segment counted from its second second. Saturation: closed loop at {', '.join(map(str, concurrencies))} "
        "clients, 8 s each, before the segments and after (the best of them, the mean of before and after). Exit "
        f"codes on SIGTERM: {exit_codes}.",
        "",
        *markdown_table(summary, {"server": "server", "saturated_rps": "saturated (req/s)",
                                  "ok_rps": "200/s in the flood (median of segments)",
                                  "goodput": "goodput", "p99_ms": "p99 ms (median)",
                                  "loop_share": "event loop's share of the core (median)",
                                  "loop_wakeups_per_s": "its wake-ups / s (median)",
                                  "failures": "5xx + transport"}),
        "",
        f"B's 200/s over A's, in each pair of neighbouring segments: "
        f"{', '.join(f'{ratio:.3f}' for ratio in pairs)} (median {statistics.median(pairs):.3f}; "
        f"B ahead in {sum(ratio > 1 for ratio in pairs)} of {len(pairs)}).",
        "",
        "## Segments",
        "",
        *markdown_table(segments, {"segment": "segment", "server": "server", "ok_rps": "200/s", "p99_ms": "p99 ms",
                                   "rejected_429": "429", "failures": "5xx + transport",
                                   "loop_share": "event loop (share)", "other_share": "other threads",
                                   "loop_wakeups_per_s": "loop wake-ups / s", "lag_p99_ms": "generator lag p99 ms"}),
        "",
        "## Saturation",
        "",
        *markdown_table(saturations, {"server": "server", "when": "when", "clients": "clients",
                                      "throughput_rps": "200/s", "p99_ms": "p99 ms",
                                      "loop_share": "event loop (share)"}),
        "",
        f"![200s and wake-ups per segment]({stem}.png)",
        "",
    ]  # fmt: skip
    write_markdown(args.out / f"{stem}.md", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="classify-linformer")
    parser.add_argument("--seconds", type=float, default=20.0, help="flood duration, each round")
    parser.add_argument("--rounds", type=int, default=3, help="floods, each between two saturation phases")
    parser.add_argument("--factor", type=float, default=3.0, help="flood rate / saturated throughput")
    parser.add_argument("--storm", type=int, default=0, metavar="CLIENTS",
                        help="flood with this many closed-loop clients that resend at once instead (see above)")
    # around the ~8 in flight at which one core saturates /classify: the best of these is the unloaded saturated
    # throughput and its p99 the unloaded p99 (with 32 or 64 clients the p99 only measures queueing, and 3x of it is no
    # bound); /translate's request-level batches grow to 32 sentences, and its throughput with them (16 clients: 302-398
    # req/s, 32: 412-476 in one run), so its saturation is measured up to 32
    parser.add_argument("--concurrencies", help="closed-loop clients for the saturation run (default: 4,8,16 for "
                        "a classify bundle, 4,8,16,32 for a translate one)")  # fmt: skip
    parser.add_argument("--setting", action="append", default=[], help="extra LINFORMER_X=value for the server")
    parser.add_argument("--alternate", metavar="K=V[,K=V...]",
                        help="A/B: the flood alternates between the server as set and one with these settings added")
    parser.add_argument("--segments", type=int, default=16, help="with --alternate: flood segments, half each")
    parser.add_argument("--stem", help="results file name (default overload-<bundle>)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    task = bundle_task(args.bundle)
    if args.alternate:
        alternate(args, task, load_before)
        return
    server = server_on_core_0(args.bundle, args.setting)
    port = server.port
    request = one_text_request(task)
    concurrencies = [int(clients) for clients in (args.concurrencies or SATURATING[task]).split(",")]
    floods: list[tuple[list[Record], dict]] = []
    try:
        asyncio.run(closed_loop(port, request, 8, 3.0))  # warm-up
        saturations = [saturation_run(server, request, concurrencies, "before round 1")]
        saturated_first = best(saturations[0])["throughput_rps"]
        flood_rate, calm_rate = args.factor * saturated_first, 0.5 * saturated_first  # the same in every round
        rss = [server.rss_mb()]
        for number in range(1, args.rounds + 1):
            phases = [(args.seconds, flood_rate), (CALM_PHASE_S, calm_rate)]
            floods.append(asyncio.run(flood_round(server, request, phases, args.storm)))
            rss.append(server.rss_mb())
            when = f"after round {number}" + (f", before round {number + 1}" if number < args.rounds else "")
            saturations.append(saturation_run(server, request, concurrencies, when))
    finally:
        exit_code = server.stop()
    rounds = [judge_round(i + 1, flood, saturations[i], saturations[i + 1], args.seconds)
              for i, flood in enumerate(floods)]  # fmt: skip
    goodput = sum(judged["goodput"] for judged in rounds) / len(rounds)
    worst_p99 = max(judged["p99_ratio"] for judged in rounds)
    failures = sum(judged["failures"] for judged in rounds)
    recoveries = [judged["recovery_s"] for judged in rounds]
    recovered = all(r is not None and r < 2 for r in recoveries)
    goals = [
        ("goodput during the flood / saturated throughput (mean of the phases around it), mean over rounds",
         goodput, ">= 0.90", goodput >= 0.9),
        ("p99 of accepted during the flood / unloaded p99 (the phase before it), worst round", worst_p99, "<= 3",
         worst_p99 <= 3),
        ("5xx and transport errors, all rounds", float(failures), "0", failures == 0),
        # (None: a round whose calm phase never came clean)
        ("recovery after the flood (s), worst round", None if None in recoveries else max(recoveries), "< 2",
         recovered),
    ]  # fmt: skip
    stem = args.stem or f"overload-{'storm-' if args.storm else ''}{args.bundle}"
    flood = (f"{args.storm} closed-loop clients resending at once" if args.storm else
             f"{args.factor:g}x flood ({flood_rate:.0f} req/s open loop)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", [{"round": judged["round"], **row} for judged in rounds
                                         for row in judged["windows"]])  # fmt: skip
    plot(rounds, args.seconds, args.out / f"{stem}.png",
         f"{args.bundle}: {flood} for {args.seconds:g} s, then "
         f"{calm_rate:.0f} req/s for {CALM_PHASE_S:g} s; {args.rounds} rounds")  # fmt: skip
    lines = header(f"Overload: {args.bundle} under {flood}", ("onnxruntime", "fastapi", "uvicorn"),
                   load_before)  # fmt: skip
    lines += [
        "Server: `python -m service` pinned to core 0 (`taskset -c 0`), 1 ORT thread, settings at their defaults "
        f"except {', '.join(f'`{k}={v}`' for k, v in server.env.items())}. Load generator: this script's raw asyncio "
        f"HTTP/1.1 client pinned to core 1, {WHAT_IS_SENT[task]} per request. The machine is shared with other "
        "jobs (load average above), so absolute rates move from run to run; the ratios compare figures from "
        "this one run.",
        "",
        f"{args.rounds} rounds of a flood ({flood}" + ("; each sends its next request the moment it is answered, "
        "429 or not" if args.storm else f", {args.factor:g}x the first saturated throughput") + f") for "
        f"{args.seconds:g} s, then {calm_rate:.0f} req/s for {CALM_PHASE_S:g} s (recovery), with an "
        "unloaded saturation phase (closed loop, 8 s at each concurrency) before the first round and after each: "
        "each round's goodput is divided by the mean saturated throughput of the phases right before and after it, "
        "so that a drift of the shared core's speed (22 % within seconds for the model alone on some VMs) falls on "
        "both. Server RSS (MB) before the first round and after each: "
        f"{', '.join(f'{mb:.0f}' for mb in rss)}; exit code on SIGTERM {exit_code}. The shares of the core are the "
        "server's CPU time over the phase's wall time, from /proc: its event-loop thread (HTTP, admission and every "
        "refusal, parsing, tokenising, answers) and its other threads (the model's compute thread).",
        "",
        "## Unloaded saturation phases",
        "",
        *markdown_table([row for phase in saturations for row in phase],
                        {"when": "when", "clients": "clients", "throughput_rps": "200/s", "p50_ms": "p50 ms",
                         "p99_ms": "p99 ms", "rejected_429": "429", "errors_5xx": "5xx",
                         "loop_share": "event loop (share of the core)", "other_share": "other threads"}),
        "",
        "## Floods",
        "",
        *markdown_table(rounds, {"round": "round", "saturated_before_rps": "saturated before (req/s)",
                                 "saturated_after_rps": "after", "ok_rps": "200/s in the flood",
                                 "goodput": "goodput", "rejected_429": "429", "failures": "5xx + transport",
                                 "p50_ms": "p50 ms", "p99_ms": "p99 ms", "unloaded_p99_ms": "unloaded p99 ms",
                                 "p99_ratio": "p99 / unloaded", "recovery_s": "recovery (s)",
                                 "loop_share": "event loop in the flood (share of the core)",
                                 "loop_share_unloaded": "in the saturation before", "other_share": "other threads",
                                 "lag_p99_ms": "generator lag p99 ms"}),
        "",
        "| goal | measured | target | met |",
        "|---|---|---|---|",
        *[f"| {name} | {'–' if value is None else f'{value:.3g}'} | {target} | {'yes' if met else '**no**'} |"
          for name, value, target, met in goals],
        "",
        f"![throughput and latency over time]({stem}.png)",
        "",
        f"Per-window figures ({WINDOW_S:g} s, by when each request was due, per round): [`{stem}.csv`]({stem}.csv).",
        "",
    ]  # fmt: skip
    write_markdown(args.out / f"{stem}.md", lines)


if __name__ == "__main__":
    main()
