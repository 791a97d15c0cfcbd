"""Step-level batching's ceiling on this machine (issue #17): the decode loop alone, no HTTP, no waiting for arrivals.

    python -m benchmarks.step_ceiling [--bundle translate-transformer] [--rows 16] [--seconds 20] [--rounds 4]

- step-level at full occupancy: `--rows` live sources from the first trip to the last, each one that finishes
  replaced by the next source of a seeded mix before the next trip, trips as StepBatcher's default
  (THROUGHPUT_TRIPS: up to 8 steps per cohort, encoding the newcomers first), through the runtime's LiveDecode:
  every live row in one decoder call per step (one cohort: the service's throughput policy since the twenty-first
  session), and grouped by width class, a call per class (the policy before it, and short-first's grouping);
- request-level on the same mix: `--rows` sources at a time, decoded whole by TranslatorRuntime.run, one batch per
  source length (the request batcher never batches requests whose options differ, and the load sends
  max_new_tokens = 2n + 8, as benchmarks/translate_load.py does).

One core, one ORT thread, greedy, the load's mix (8-256 tokens, uniformly, as benchmarks/translate_load.py sends);
the modes take turns, round by round, on the same sources. Nothing waits for a request here, so a step-level figure
is the most a step-level server could make of this mix with that grouping: a server adds HTTP and rows left empty
between a request's end and its user's next one. Also the decoder calls: how many a second, ms per call, the share of
the time in them and decoder ms per generated token. Writes step_ceiling-<bundle>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.int8 import padded, translator  # noqa: E402
from benchmarks.translate_load import LENGTHS  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from loadtest.texts import texts_of_length, translate_max_new_tokens  # noqa: E402
from service.batcher import THROUGHPUT_TRIPS  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

Source = tuple[int, list[int], tuple[int, int]]  # key, token ids, options (beam 1, max_new_tokens)


def sources(pool: dict[int, list[list[int]]], seed: int) -> Iterator[Source]:
    rng = random.Random(seed)
    for key in itertools.count():
        n = rng.choice(LENGTHS)
        yield key, pool[n][key % len(pool[n])], (1, translate_max_new_tokens(n))


def step_level(runtime, pad_id: int, mix: Iterator[Source], rows: int, seconds: float, width_classes: bool) -> int:
    """Generated tokens in `seconds` with `rows` sources live throughout."""
    live, keys, tokens = runtime.live(width_classes), set(), 0
    limits = THROUGHPUT_TRIPS
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        joining = [next(mix) for _ in range(rows - len(keys))]
        if joining:
            live.admit(*padded([ids for _, ids, _ in joining], pad_id), [(key, options) for key, _, options in joining])
            keys |= {key for key, _, _ in joining}
        finished, failed = live.step(limits.steps, None, limits.budget_s)
        if failed:
            raise next(iter(failed.values()))
        for key, output in finished.items():
            tokens += len(output)
            keys.discard(key)
    live.drop(keys)
    return tokens


def request_level(runtime, pad_id: int, mix: Iterator[Source], rows: int, seconds: float) -> int:
    """Generated tokens in `seconds`, `rows` sources at a time in one batch per length."""
    tokens = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        by_options: dict[tuple[int, int], list[list[int]]] = {}
        for _, ids, options in itertools.islice(mix, rows):
            by_options.setdefault(options, []).append(ids)
        for options, batch in by_options.items():
            tokens += sum(map(len, runtime.run(*padded(batch, pad_id), options)))
    return tokens


MODES: dict[str, Callable[..., int]] = {
    "step-level, one cohort": functools.partial(step_level, width_classes=False),
    "step-level, width classes": functools.partial(step_level, width_classes=True),
    "request-level": request_level,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="translate-transformer")
    parser.add_argument("--rows", type=int, default=16, help="live sources (step-level), sources per round (request)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    os.sched_setaffinity(0, {args.core})
    bundle = load_bundle(REPO / "models" / args.bundle)
    runtime, tokenizer = translator(bundle), Tokenizer.from_bundle(bundle)
    pool = {n: [e.ids for e in tokenizer.encode_all(list(texts_of_length("translate", n)), truncate=True)]
            for n in LENGTHS}  # fmt: skip
    calls: list[float] = []  # seconds of each decoder call
    run_with_iobinding = runtime.decoder.run_with_iobinding

    def timed(binding) -> None:
        started = time.perf_counter()
        run_with_iobinding(binding)
        calls.append(time.perf_counter() - started)

    runtime.decoder.run_with_iobinding = timed
    rows = []
    for round_ in range(args.rounds):
        order = list(MODES.items())
        for mode, run in order[round_ % len(order):] + order[: round_ % len(order)]:  # each mode first in turn
            calls.clear()
            started = time.perf_counter()
            tokens = run(runtime, bundle.pad_id, sources(pool, round_), args.rows, args.seconds)
            elapsed = time.perf_counter() - started
            rows.append({"round": round_ + 1, "mode": mode, "tokens_per_s": round(tokens / elapsed, 1),
                         "decoder_calls_per_s": round(len(calls) / elapsed, 1),
                         "ms_per_decoder_call": round(1000 * statistics.mean(calls), 3),
                         "decoder_share": round(sum(calls) / elapsed, 3),
                         "decoder_ms_per_token": round(1000 * sum(calls) / tokens, 4)})  # fmt: skip
            print(rows[-1], flush=True)
    stem = args.out / f"step_ceiling-{args.bundle}"
    write_csv(stem.with_suffix(".csv"), rows)
    by_round = {(r["round"], r["mode"]): r["tokens_per_s"] for r in rows}
    summary = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ratios = [by_round[r["round"], mode] / by_round[r["round"], "request-level"] for r in mine]
        summary.append({"mode": mode, **{key: statistics.median(r[key] for r in mine) for key in mine[0]
                                         if key not in ("round", "mode")},
                        "ratio": f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"})  # fmt: skip
    columns = {"tokens_per_s": "generated tokens/s", "decoder_calls_per_s": "decoder calls/s",
               "ms_per_decoder_call": "ms per call", "decoder_share": "share of the time in decoder calls",
               "decoder_ms_per_token": "decoder ms per token"}  # fmt: skip
    lines = header(f"Step-level batching's ceiling: {args.bundle}, {args.rows} rows", ("onnxruntime", "numpy"),
                   load_before)  # fmt: skip
    lines += [
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"Medians of {args.rounds} rounds ({args.seconds:g} s per mode and round); tokens/s against request-level's "
        "in the same round, median (range):",
        "",
        *markdown_table(summary, {"mode": "mode", **columns, "ratio": "/ request-level"}),
        "",
        "Every round:",
        "",
        *markdown_table(rows, {"round": "round", "mode": "mode", **columns}),
        "",
        f"![tokens/s by round]({stem.name}.png)",
    ]
    write_markdown(stem.with_suffix(".md"), lines)
    fig, ax = agg_subplots(figsize=(6.5, 3.6))
    for offset, mode in enumerate(MODES):
        mine = [r for r in rows if r["mode"] == mode]
        ax.bar([r["round"] + 0.27 * (offset - 1) for r in mine], [r["tokens_per_s"] for r in mine], width=0.27,
               label=mode)  # fmt: skip
    ax.set_title(f"{args.bundle}: {args.rows} rows, the load's mix, no HTTP")
    ax.set_xlabel("round")
    ax.set_ylabel("generated tokens/s")
    ax.legend(fontsize=8)
    save_figure(fig, stem.with_suffix(".png"), 110)


if __name__ == "__main__":
    main()
