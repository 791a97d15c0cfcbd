"""Development run behind reliability-session17/README.md: the server pinned to core 0 (benchmarks/loadgen.py), a
saturation of 16 closed-loop clients for 6 s, then open loop: 4 s at 1.5x that (a pile-up below the 2x flood test),
30 s at 0.7x (the soak's rate); per 2-s window the 200s, refusals, peak in flight and the server's event-loop and
compute-thread shares of its core.

    python benchmarks/results/reliability-session17/open_loop_shares.py [LINFORMER_X=value ...]
"""

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.loadgen import (  # noqa: E402
    REVIEW,
    classify_server_on_core_0,
    closed_loop,
    open_loop,
    peak_outstanding,
    percentile,
    post_request,
)

WINDOW_S = 2.0


def main() -> None:
    server = classify_server_on_core_0("classify-linformer", sys.argv[1:])
    request = post_request("/classify", json.dumps({"text": REVIEW}).encode())
    try:
        asyncio.run(closed_loop(server.port, request, 8, 3.0))
        saturated = sum(r.status == 200 for r in asyncio.run(closed_loop(server.port, request, 16, 6.0))) / 6.0
        marks = []

        async def run() -> list:
            started = time.perf_counter()

            async def sample() -> None:
                while True:
                    marks.append((time.perf_counter() - started, *server.cpu_s()))
                    await asyncio.sleep(WINDOW_S)

            sampler = asyncio.create_task(sample())
            try:
                phases = [(4.0, 1.5 * saturated), (30.0, 0.7 * saturated)]
                return await open_loop(server.port, request, phases, started=started)
            finally:
                sampler.cancel()

        records = asyncio.run(run())
    finally:
        server.stop()
    peaks = peak_outstanding(records, WINDOW_S)
    print(f"saturated {saturated:.0f} req/s, then {1.5 * saturated:.0f} for 4 s and {0.7 * saturated:.0f} for 30 s")
    for i in range(17):
        lo, hi = WINDOW_S * i, WINDOW_S * (i + 1)
        inside = [r for r in records if lo <= r.due_s < hi]
        ok = [r.latency_s for r in inside if r.status == 200]
        done = sum(r.status == 200 and lo <= r.due_s + r.latency_s < hi for r in records) / WINDOW_S
        pair = [m for m in marks if m[0] >= lo][:2]
        shares = []
        if len(pair) == 2:
            (t0, *cpu0), (t1, *cpu1) = pair
            shares = [(b - a) / (t1 - t0) for a, b in zip(cpu0, cpu1, strict=True)]
        print(f"{lo:4.0f} s: 200s answered/s {done:5.0f}, refused {len(inside) - len(ok):4d}, "
              f"p50 {percentile(ok, 50) * 1000 if ok else 0:7.1f} ms, peak in flight {peaks.get(i, 0):5d}, "
              f"event loop / compute threads {' / '.join(f'{s:.2f}' for s in shares) or '-'}")  # fmt: skip


if __name__ == "__main__":
    main()
