"""What the cyclic garbage collector costs the service under load (thirty-third session, issue #20): `python -m
service` with a `gc.callbacks` hook timing every collection in the thread's CPU time (`time.thread_time`), counted
from the start-up's `gc.freeze()` on (the collections while importing and loading are left out); at SIGINT, per
generation: collections, CPU, objects collected. A development measurement.

    LINFORMER_PORT=8232 LINFORMER_CLASSIFY_MODEL=classify-linformer LINFORMER_TRANSLATE_MODEL= \
        LINFORMER_ORT_INTRA_OP_THREADS=1 LINFORMER_ORT_INTER_OP_THREADS=1 LINFORMER_LOG_LEVEL=warning \
        LINFORMER_MAX_CONCURRENT_REQUESTS=256 taskset -c 0 python benchmarks/results/service-bench-session33/gc_cost.py
    taskset -c 1 wrk -t1 -c64 -d10s -s body64.lua http://127.0.0.1:8232/classify    # then SIGINT the server
"""

import atexit
import gc
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

counting = False
started = 0.0
totals = {generation: [0, 0.0, 0] for generation in range(3)}  # collections, CPU seconds, objects collected


def timed(phase: str, info: dict) -> None:
    global started
    if not counting:
        return
    if phase == "start":
        started = time.thread_time()
        return
    total = totals[info["generation"]]
    total[0] += 1
    total[1] += time.thread_time() - started
    total[2] += info["collected"]


def report() -> None:
    print(f"thresholds {gc.get_threshold()}, frozen objects {gc.get_freeze_count()}")
    for generation, (collections, seconds, collected) in totals.items():
        each = seconds / collections * 1e6 if collections else 0.0
        print(
            f"generation {generation}: {collections} collections, {seconds * 1e3:.1f} ms CPU ({each:.0f} us each), "
            f"{collected} objects collected"
        )


def main() -> None:
    import service.app

    freeze = gc.freeze

    def freeze_then_count() -> None:  # service.app's lifespan freezes the loaded app, then serves
        global counting
        freeze()
        counting = True

    service.app.gc.freeze = freeze_then_count
    gc.callbacks.append(timed)
    atexit.register(report)
    from service.__main__ import main as serve

    serve([])


if __name__ == "__main__":
    main()
