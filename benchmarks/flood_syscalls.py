"""What a refused request costs the server in system calls: count them during a flood.

    python -m benchmarks.flood_syscalls [--rate 6000] [--tree DIR] [--stem NAME] [--out DIR]

The overload set-up (`python -m service` on core 0, 1 ORT thread, default settings; the load on core 1), an open-loop
flood at `--rate` requests/s (about 3x the saturated throughput here), and in its middle `perf trace -s` on the
server for `--trace-s` seconds: the system calls of each thread, counted in the kernel. The server's /metrics before
and after give the share of 200s and 429s. Then a short `strace -f -tt` sample shows what each call carried:
a 429 answered from the header-parser callback is one write (head and body), one answered by an ASGI task is two
(head, then body), so the sample tells the two paths apart. `--tree` runs another checkout's server (main's, to
compare in one session). perf trace and strace slow the server, so the counts per request, not the rates, are
the result. Needs root or perf_event_paranoid <= 1. Writes <stem>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import bundle_task, one_text_request, open_loop, server_on_core_0  # noqa: E402
from loadtest.report import header, load_average, markdown_table, write_csv  # noqa: E402


def answered(port: int) -> dict[str, float]:
    """/classify answers so far by status, from the server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    pattern = r'linformer_requests_total\{route="/classify",status="(\d+)"\} (\S+)'
    return {status: float(count) for status, count in re.findall(pattern, text)}


def event_loop_syscalls(perf_summary: str, pid: int) -> dict[str, int]:
    """The main thread's (the event loop's; its thread id is the pid) calls per syscall from `perf trace -s`."""
    counts: dict[str, int] = {}
    inside = False
    for line in perf_summary.splitlines():
        thread = re.match(r"\s*\S+ \((\d+)\), \d+ events", line)
        if thread:
            inside = int(thread.group(1)) == pid
            continue
        row = re.match(r"\s+([a-z_0-9]+)\s+(\d+)\s+\d+\s+[\d.]+", line)
        if inside and row:
            counts[row.group(1)] = int(row.group(2))
    return counts


def write_kinds(strace_log: str) -> dict[str, int]:
    """What the sampled writes carried: a refusal's head (with its body when written in one call), a body alone."""
    kinds = {"429 head": 0, "error body alone": 0, "200 head": 0, "other": 0}
    for payload in re.findall(r' write\(\d+, "(.{0,16})', strace_log):
        kind = ("429 head" if payload.startswith("HTTP/1.1 429") else "200 head" if payload.startswith("HTTP/1.1 200")
                else "error body alone" if payload.startswith('{\\"error') else "other")  # fmt: skip
        kinds[kind] += 1
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="classify-linformer")
    parser.add_argument("--rate", type=float, default=6000.0, help="flood, requests per second (open loop)")
    parser.add_argument("--seconds", type=float, default=14.0, help="flood duration")
    parser.add_argument("--warm-s", type=float, default=5.0, help="flood before the count starts")
    parser.add_argument("--trace-s", type=float, default=4.0)
    parser.add_argument("--sample-s", type=float, default=1.0, help="strace sample after the count")
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose server runs")
    parser.add_argument("--stem", default="flood-syscalls")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    server = server_on_core_0(args.bundle, [], tree=args.tree.resolve())
    pid, port = server.proc.pid, server.port
    traced: dict = {}

    def count_during_the_flood() -> None:
        time.sleep(args.warm_s)
        before = answered(port)
        perf = subprocess.run(["perf", "trace", "-s", "-p", str(pid), "--", "sleep", str(args.trace_s)],
                              capture_output=True, text=True)  # fmt: skip
        after = answered(port)
        sample = args.out / f"{args.stem}-strace-sample.txt"
        subprocess.run(["timeout", "-s", "INT", str(args.sample_s), "strace", "-f", "-tt", "-p", str(pid),
                        "-o", str(sample)])  # fmt: skip
        traced.update(before=before, after=after, perf=perf.stdout + perf.stderr,
                      sample=sample.read_text() if sample.exists() else "")  # fmt: skip
        sample.unlink(missing_ok=True)  # large; its counts go into the results

    counter = threading.Thread(target=count_during_the_flood)
    try:
        request = one_text_request(bundle_task(args.bundle, args.tree.resolve()))
        counter.start()
        records = asyncio.run(open_loop(port, request, [(args.seconds, args.rate)]))
        counter.join()
    finally:
        server.stop()
    delta = {status: traced["after"].get(status, 0) - traced["before"].get(status, 0) for status in ("200", "429")}
    share_ok = delta["200"] / max(1.0, delta["200"] + delta["429"])
    calls = event_loop_syscalls(traced["perf"], pid)
    # every request is read by one read() (the sample shows no request needing two), so reads count requests
    requests = calls.get("read", 0)
    ok, refused = requests * share_ok, requests * (1 - share_ok)
    # writes: one per refusal from the callback, two per 200 and per refusal from an ASGI task (head, body)
    asgi_refusals = max(0.0, calls.get("write", 0) - requests - ok)
    rows = [{"syscall": name, "calls": n, "per_request": n / max(1, requests)} for name, n in
            sorted(calls.items(), key=lambda item: -item[1])]  # fmt: skip
    kinds = write_kinds(traced["sample"])
    write_csv(args.out / f"{args.stem}.csv", rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row["per_request"] >= 0.001]
    fig, axis = plt.subplots(figsize=(8, 4))
    axis.barh([row["syscall"] for row in shown][::-1], [row["per_request"] for row in shown][::-1])
    axis.set_xlabel("calls per request read (event-loop thread)")
    axis.set_title(f"{args.stem}: system calls during a {args.rate:.0f} req/s flood", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.stem}.png", dpi=110)
    plt.close(fig)

    lines = header("System calls per request during a flood", ("onnxruntime", "uvicorn", "uvloop", "httptools"),
                   load_before)  # fmt: skip
    lines += [
        f"Server tree: `{args.tree}`. Flood: {args.rate:.0f} req/s open loop for {args.seconds:g} s "
        f"({sum(r.status == 200 for r in records)} answered 200, {sum(r.status == 429 for r in records)} 429, "
        f"{sum(r.status == 0 for r in records)} transport errors); `perf trace -s -p` on the server for "
        f"{args.trace_s:g} s from {args.warm_s:g} s in (perf slows the server: compare counts per request, not rates).",
        "",
        f"In the traced interval the server read **{requests}** requests; /metrics around it: {delta['200']:.0f} "
        f"answered 200, {delta['429']:.0f} answered 429 ({share_ok:.1%} 200). Writes beyond one per request and one "
        f"more per 200: **{asgi_refusals:.0f}**, about **{asgi_refusals / max(1.0, refused):.1%}** of the refusals "
        f"answered by an ASGI task (head and body written separately) instead of the header-parser callback (an "
        f"estimate: the 200s' share comes from /metrics read around the count, a few percent of requests either way; "
        f"the strace sample below counts them directly).",
        "",
        f"strace sample ({args.sample_s:g} s, `strace -f -tt`, after the count): writes by what they carried: {kinds}; "
        f"429 answered by an ASGI task in it: {kinds['error body alone'] / max(1, kinds['429 head']):.1%}.",

        "",
        "## Event-loop thread, calls per request read",
        "",
        *markdown_table(rows, {"syscall": "syscall", "calls": "calls", "per_request": "per request"}),
        "",
        f"![calls per request]({args.stem}.png)",
        "",
        "All threads, as perf printed it:",
        "",
        "```",
        *traced["perf"].strip().splitlines(),
        "```",
        "",
    ]  # fmt: skip
    (args.out / f"{args.stem}.md").write_text("\n".join(lines))
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
