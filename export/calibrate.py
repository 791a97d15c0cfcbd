"""The batcher's token budget for a classify bundle, from measurement: texts/s against batch size x length.

A batch is not always cheaper per text than a single text on a CPU: past a size that depends on the model
and the machine (caches, the attention's n x k matrices), texts/s falls again. On the AMD EPYC core here,
64-token texts run fastest in batches of about 8, and 512-token texts in batches of 1 to 4 (~20 % slower per
text at 32). The dynamic batcher caps a batch at `max_batch_tokens` padded tokens (batch x longest), so one
budget serves every length: this picks the budget under which the worst length runs closest to its own
best rate, and, under that budget, each length's own batch size (the largest within BATCH_ALLOWANCE of its
best), and writes both with the table into the bundle's manifest.json, where the service reads them
(LINFORMER_MAX_BATCH_TOKENS still overrides them: an explicit budget alone then decides).

Timed with one ORT thread (the served set-up: one core per server process) in CPU seconds of this process,
so another process sharing the core does not skew it. Export runs it; run it again on the machine that
serves if that is a different kind of CPU:

    python -m export calibrate --bundle models/classify-linformer
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from loadtest.report import cpu_model

LENGTHS = (16, 64, 128, 256, 512, 1024)
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# run-to-run spread of one rate on a shared core (median of the repeats): differences below it decide nothing
NOISE = 0.03
# How much slower per text, in this table, a length's batch size may be than that length's best and still be chosen
# over the smaller sizes. Each batch also costs the service a fixed amount the table leaves out (the trip to the
# compute thread, padding, waking its requests, and a model run that starts on caches the requests' own work left
# cold), which bigger batches pay less often. Served side by side (benchmarks/results/batch-sizes-session27/), the
# sizes chosen with 5 % served as fast or faster than those chosen with 3 % at every length: +5 % req/s at 64 tokens
# (16 instead of 8), +8 % at 128 (8 instead of 4), +6.5 % at 1,024 (2 instead of 1), level at 256 (8 instead of 4),
# the same sizes at 16 and 512; 32 at 16 and 64 tokens (0.93 of the best) served slower than 8 and 16.
BATCH_ALLOWANCE = 0.05


def _session(model: Path, threads: int) -> ort.InferenceSession:
    """As the service makes the classifier's (service/app.py): ORT's CPU arena and memory patterns on. Without
    them every run allocates its activations afresh, which costs big batches more than small ones, so the
    arena setting moves the best budget: calibrate with the one that serves."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    options.enable_cpu_mem_arena = options.enable_mem_pattern = True
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])


def texts_per_cpu_second(session: ort.InferenceSession, length: int, vocab_size: int, tokens: int = 16384,
                         repeats: int = 5) -> dict[int, float]:  # fmt: skip
    """batch size -> median over `repeats` of texts per CPU second, each repeat about `tokens` real tokens of
    work. The batch sizes take turns within each repeat, so a slow spell of a shared core (another process's
    cache traffic) falls on all of them instead of on one: the per-length choice compares them with each other."""
    rng = np.random.default_rng(0)
    feeds = {}
    for batch in BATCH_SIZES:
        ids = rng.integers(4, vocab_size, size=(batch, length), dtype=np.int64)
        feeds[batch] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        session.run(None, feeds[batch])  # the first run of a shape allocates
    rates: dict[int, list[float]] = {batch: [] for batch in BATCH_SIZES}
    for _ in range(repeats):
        for batch in BATCH_SIZES:
            runs = max(1, tokens // (batch * length))
            started = time.process_time()
            for _ in range(runs):
                session.run(None, feeds[batch])
            rates[batch].append(runs * batch / max(time.process_time() - started, 1e-9))
    return {batch: statistics.median(batch_rates) for batch, batch_rates in rates.items()}


def measure(model: Path, n_max: int, vocab_size: int, threads: int = 1) -> dict[int, dict[int, float]]:
    """length -> batch size -> texts per CPU second."""
    session = _session(model, threads)
    return {length: texts_per_cpu_second(session, length, vocab_size) for length in LENGTHS if length <= n_max}


def choose_budget(table: dict[int, dict[int, float]], max_batch_size: int = max(BATCH_SIZES)) -> tuple[int, float]:
    """-> (max_batch_tokens, worst ratio). A budget lets texts of length L form batches of
    min(max_batch_size, budget // L), taken at the largest measured size not above that; its score is the
    worst length's rate under it as a fraction of that length's best. Among the budgets B x L measured, the
    largest whose score is within NOISE of the best score: a smaller one would win on noise alone, and every
    batch also costs the service a fixed amount (padding, a thread hop, futures) that these figures leave out."""

    def rate_under(budget: int, length: int) -> float:
        allowed = min(max_batch_size, max(1, budget // length))
        return table[length][max(b for b in table[length] if b <= allowed)]

    best = {length: max(rates.values()) for length, rates in table.items()}
    candidates = sorted({batch * length for length, rates in table.items() for batch in rates})
    scores = {budget: min(rate_under(budget, length) / best[length] for length in table) for budget in candidates}
    top = max(scores.values())
    budget = max(b for b, score in scores.items() if score >= top - NOISE)
    return budget, scores[budget]


def choose_batch_sizes(table: dict[int, dict[int, float]]) -> dict[int, int]:
    """-> length -> the largest batch size whose rate is within BATCH_ALLOWANCE of that length's best. One budget
    has to suit every length at once; this lets each length batch as far as the service still gains, and no
    further. The largest rather than the best: each batch costs the service a fixed amount on top that fewer, bigger
    batches pay less often, worth more than the few per cent the table puts between neighbouring sizes."""
    return {length: max(b for b, rate in rates.items() if rate >= (1 - BATCH_ALLOWANCE) * max(rates.values()))
            for length, rates in table.items()}  # fmt: skip


def calibrate_bundle(bundle: Path, threads: int = 1, reuse_table: bool = False) -> dict:
    """Measure, choose, and write `batching` into bundle/manifest.json (its `files` are left as they are).
    `reuse_table`: choose again from the table the manifest already holds, without measuring (for a bundle
    calibrated before a choice was added; the table stays as it was measured, on the machine it names)."""
    config = json.loads((bundle / "config.json").read_text())
    if config.get("task") != "classify":
        raise ValueError(f"{bundle} is a {config.get('task')!r} bundle; the calibration is for classify bundles")
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if reuse_table:
        recorded = manifest.get("batching", {})
        if "texts_per_cpu_second" not in recorded:
            raise ValueError(f"{bundle}: manifest.json holds no measured table to reuse; calibrate without it")
        table = {int(length): {int(b): r for b, r in rates.items()}
                 for length, rates in recorded["texts_per_cpu_second"].items()}  # fmt: skip
        measured_with = recorded["measured_with"]
    else:
        model = bundle / config.get("onnx", {}).get("model", "model.onnx")
        table = measure(model, int(config["n_max"]), int(config["model_config"]["vocab_size"]), threads)
        measured_with = {"ort_threads": threads, "cpu": cpu_model(), "nproc": os.cpu_count(),
                         "onnxruntime": ort.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
    budget, worst_ratio = choose_budget(table)
    batching = {
        "max_batch_tokens": budget,
        "worst_length_ratio_to_best": round(worst_ratio, 3),
        # under the budget, each measured length's own cap; the service takes a batch's padded length to the next
        # measured length up (the longest measured one's cap beyond it)
        "max_batch_size_by_length": {str(length): size for length, size in choose_batch_sizes(table).items()},
        "texts_per_cpu_second": {str(length): {str(b): round(r, 1) for b, r in rates.items()}
                                 for length, rates in table.items()},  # fmt: skip
        "measured_with": measured_with,
    }
    manifest["batching"] = batching
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return batching


def table_markdown(batching: dict) -> str:
    """The measured table as Markdown, each row relative to its length's best batch size."""
    rows = batching["texts_per_cpu_second"]
    sizes = list(next(iter(rows.values())))
    lines = ["| tokens | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for length, rates in rows.items():
        best = max(rates.values())
        cells = [f"**{r:.0f}**" if r == best else f"{r:.0f} ({r / best:.2f})" for r in rates.values()]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
