"""Alternating A/B under the same open-loop flood: two servers on core 0 (one flooded at a time), short phases.

    python benchmarks/results/reliability-session26/abflood.py RATE SECONDS PAIRS

A: the service as it is; B: with EXP_SLICE_US (B_SLICE_US, default 5000) in its environment, which only the tried
change in compute-thread-slice.diff reads. Kept as the record of that try (twenty-sixth session), not a benchmark."""

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.loadgen import closed_loop, one_text_request, open_loop, server_on_core_0  # noqa: E402
from benchmarks.overload import core_shares, cpu_mark  # noqa: E402


def main() -> None:
    variants = {"A": {}, "B": {"EXP_SLICE_US": os.environ.get("B_SLICE_US", "5000")}}
    rate, seconds, reps = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    servers = {}
    for name, extra in variants.items():
        saved = dict(os.environ)
        os.environ.update(extra)  # the server process inherits it
        servers[name] = server_on_core_0("classify-linformer", [])
        os.environ.clear()
        os.environ.update(saved)
    request = one_text_request("classify")
    try:
        for server in servers.values():
            asyncio.run(closed_loop(server.port, request, 8, 3.0))  # warm-up
        results = {name: [] for name in servers}
        for rep in range(reps):
            for name in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                server = servers[name]
                mark = cpu_mark(server)
                records = asyncio.run(open_loop(server.port, request, [(seconds, rate)]))
                shares = core_shares(server, mark)
                ok = sum(r.status == 200 for r in records) / seconds
                refused = sum(r.status == 429 for r in records) / seconds
                bad = sum(r.status == 0 or r.status >= 500 for r in records)
                latencies = sorted(r.latency_s for r in records if r.status == 200)
                p99 = latencies[int(0.99 * len(latencies))] * 1000 if latencies else float("nan")
                results[name].append(ok)
                print(f"rep {rep} {name}: 200/s {ok:.0f} 429/s {refused:.0f} bad {bad} p99 {p99:.1f} ms "
                      f"loop {shares['loop_share']:.3f} other {shares['other_share']:.3f}", flush=True)  # fmt: skip
                time.sleep(2)
        for name, rates in results.items():
            print(name, "median 200/s", statistics.median(rates), "all", [round(x) for x in rates])
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
