"""Does memory go back to its baseline after a huge request? ORT's CPU arena kept and given back, side by side.

    python -m benchmarks.memory [--out benchmarks/results]

For each setting of LINFORMER_ORT_CPU_MEM_ARENA (true: every session keeps its arena's peak; false, the
default: the classifier's arena is shrunk after big batches, the translator runs without one) the served
process (both committed bundles, 1 ORT thread) is measured: RSS when idle after warm-up, the peak during one
huge /translate request (64 texts x beam 8 x up to 256 new tokens, the issue's case; the per-request budget and
the queue bound are raised to let it in), RSS 3 s after it, then the same for one huge /classify request (64
texts of n_max tokens, truncated), and the p50 latency of small requests (one-text /classify and greedy
/translate) before the huge ones. Writes memory.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import REVIEW, Server, free_port  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)

SOURCES = [
    "The documents are stored in the folder you selected.",
    "Click the button to insert a new table into the current sheet.",
    "This function returns the number of characters in a text string.",
    "You can change the default settings in the options dialog.",
]


def post(port: int, path: str, body: dict, timeout: float = 600) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, time.perf_counter() - started


def p50_ms(port: int, path: str, body: dict, runs: int) -> float:
    return statistics.median(post(port, path, body)[1] for _ in range(runs)) * 1000


def measure(arena: bool) -> dict:
    port = free_port()
    env = {"LINFORMER_ORT_CPU_MEM_ARENA": str(arena).lower(), "LINFORMER_ORT_INTRA_OP_THREADS": "1",
           "LINFORMER_LOG_LEVEL": "warning", "LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST": str(64 * 8 * 256),
           "LINFORMER_MAX_QUEUED_DECODE_TOKENS": str(64 * 8 * 256),
           "LINFORMER_REQUEST_TIMEOUT_S": "600", "LINFORMER_MAX_BODY_BYTES": str(8 << 20)}  # fmt: skip
    server = Server(port, env, cores=None)
    try:
        for _ in range(20):
            post(port, "/classify", {"text": REVIEW})
            post(port, "/translate", {"text": SOURCES[0]})
        time.sleep(1)
        idle = server.rss_mb()
        classify_ms = p50_ms(port, "/classify", {"text": REVIEW}, 200)
        translate_ms = p50_ms(port, "/translate", {"text": SOURCES[1]}, 30)
        peak, done = idle, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, server.rss_mb())
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        huge = {"texts": [SOURCES[i % 4] for i in range(64)], "beam_size": 8, "max_new_tokens": 4096,
                "split_sentences": False}  # 64 rows, as the budget above allows
        status, huge_s = post(port, "/translate", huge)
        done.set()
        sampler.join()
        time.sleep(3)
        after = server.rss_mb()
        # n_max tokens each: every text runs alone (longer than the calibrated budget) and past the shrink size
        long_review = " ".join([REVIEW] * 150)
        classify_status, classify_s = post(port, "/classify", {"texts": [long_review] * 64, "truncate": True})
        time.sleep(3)
        after_classify = server.rss_mb()
    finally:
        server.stop()
    return {"ort_cpu_mem_arena": arena, "rss_idle_mb": idle, "rss_peak_mb": peak, "rss_3s_after_mb": after,
            "kept_mb": after - idle, "huge_request_status": status, "huge_request_s": huge_s,
            "rss_3s_after_classify_mb": after_classify, "kept_after_classify_mb": after_classify - idle,
            "huge_classify_status": classify_status, "huge_classify_s": classify_s,
            "classify_p50_ms": classify_ms, "translate_p50_ms": translate_ms}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    rows = [measure(arena) for arena in (True, False)]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "memory.csv", rows)
    plot(rows, args.out / "memory.png")
    lines = header("Memory after a huge request, ORT CPU arena kept and given back", ("onnxruntime",), load_before)
    lines += [
        "`python -m service` with both committed bundles, 1 ORT thread, unpinned; one request of 64 texts x "
        "beam 8 x max_new_tokens 4096 (capped at the bundle's 256), the per-request budget and the queue bound "
        "raised to let it in; then one /classify request of 64 texts of the bundle's n_max tokens (truncated). "
        "RSS from /proc (the peak sampled every 50 ms during the translation); p50 of 200 one-text /classify and "
        "30 greedy one-text /translate requests, sequential, before the huge ones. ORT CPU arena: "
        "LINFORMER_ORT_CPU_MEM_ARENA (true: every session keeps its arena's peak; false, the default: the "
        "classifier's arena is shrunk after batches of LINFORMER_ORT_ARENA_SHRINK_TOKENS or more, the translator "
        "runs without one). The machine is shared with other jobs (load average above): the latencies move with it.",
        "",
        *markdown_table(rows, {"ort_cpu_mem_arena": "ORT CPU arena", "rss_idle_mb": "RSS idle (MB)",
                               "rss_peak_mb": "peak (MB)", "rss_3s_after_mb": "3 s after (MB)",
                               "kept_mb": "kept (MB)", "huge_request_status": "status",
                               "huge_request_s": "huge request (s)",
                               "rss_3s_after_classify_mb": "3 s after the huge /classify (MB)",
                               "kept_after_classify_mb": "kept (MB)", "huge_classify_status": "status",
                               "huge_classify_s": "huge /classify (s)",
                               "classify_p50_ms": "/classify p50 (ms)", "translate_p50_ms": "/translate p50 (ms)"}),
        "",
        "![RSS before, at the peak and after](memory.png)",
        "",
    ]  # fmt: skip
    write_markdown(args.out / "memory.md", lines)


def plot(rows: list[dict], path: Path) -> None:
    fig, axis = agg_subplots(figsize=(7, 3.5))
    labels = ["idle", "peak", "3 s after", "3 s after /classify"]
    for i, row in enumerate(rows):
        values = [row["rss_idle_mb"], row["rss_peak_mb"], row["rss_3s_after_mb"], row["rss_3s_after_classify_mb"]]
        kept = "kept" if row["ort_cpu_mem_arena"] else "given back after big batches"
        axis.bar([x + (i - 0.5) * 0.4 for x in range(4)], values, width=0.4, label=f"arena {kept}")
    axis.set_xticks(range(4), labels)
    axis.set_ylabel("server RSS (MB)")
    axis.set_title("One 64-text, beam-8 /translate request, then 64 n_max-token texts to /classify", fontsize=9)
    axis.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
