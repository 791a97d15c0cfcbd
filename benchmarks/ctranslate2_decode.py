"""Ours vs CTranslate2 on the same weights, model level: greedy decode speed and output parity (a benchmark).

Four decoders of the one vanilla-Transformer translator, all in this process with 1 thread each:
- ours fp32: service/runtime.py's TranslatorRuntime (what /translate runs) on models/translate-transformer;
- ours int8: the same runtime on models/translate-transformer-int8 (ONNX Runtime dynamic quantisation);
- CTranslate2 fp32 / int8: the same bundle converted by export/ctranslate2.py, loaded with compute_type float32
  or int8 (CTranslate2 quantises the weights when it loads them), intra_threads 1, inter_threads 1.

Speed: greedy decoding to EOS (at most 256 tokens) of the first test sources at batch 1 (single stream), 8 and
32 (length-sorted groups, as a batcher groups them); the variants take turns call by call (benchmarks/int8.py's
`interleaved_decoding`), median over rounds; tokens = decoder steps including the EOS. CPU seconds of the
process and wall seconds are both reported.
Parity and quality: the whole test set, greedy, batches of 32: how many translations are token-identical to
ours fp32, and sacrebleu BLEU / chrF.

`--new-buffers` adds a fifth variant, ours fp32 on new decode buffers and IO bindings for every call (as before the
runtime kept small ones for the next decode, service/runtime.py SPARE_DECODE_BYTES), taking its turns with the rest.

    .venv/bin/python -m benchmarks.ctranslate2_decode [--out benchmarks/results/ctranslate2-decode]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ctranslate2_server import CTranslate2Runtime  # noqa: E402
from benchmarks.int8 import decode_in_batches, interleaved_decoding, padded, translator  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service.bundle import load_bundle  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402
from training.translate import read_pairs  # noqa: E402


class NewBuffers:
    """A runtime of its own that never finds the buffers its last decode left (`--new-buffers`)."""

    def __init__(self, runtime):
        self.runtime = runtime

    def run(self, *args):
        self.runtime._spare = None
        return self.runtime.run(*args)


def runtimes(models_dir: Path, bundle: str, threads: int, new_buffers: bool = False) -> dict:
    if threads != 1:  # benchmarks.int8.translator builds 1-thread sessions: ours would not match
        raise SystemExit("--threads other than 1 is not supported yet: ours are built with 1 ORT thread")
    fp32 = load_bundle(models_dir / bundle)
    return {
        "ours fp32": translator(fp32),
        "ours int8": translator(load_bundle(models_dir / f"{bundle}-int8")),
        "CTranslate2 fp32": CTranslate2Runtime(fp32, "float32", threads),
        "CTranslate2 int8": CTranslate2Runtime(fp32, "int8", threads),
        **({"ours fp32, new buffers": NewBuffers(translator(fp32))} if new_buffers else {}),
    }


def speed(decoders: dict, ids: list[list[int]], batches: list[int], rounds: int, pad_id: int) -> list[dict]:
    rows = []
    for batch in batches:
        order = list(range(len(ids))) if batch == 1 else sorted(range(len(ids)), key=lambda i: len(ids[i]))
        groups = [padded([ids[i] for i in order[s : s + batch]], pad_id) for s in range(0, len(order), batch)]
        load = load_average()
        timed, steps = interleaved_decoding(decoders, groups, rounds)
        for variant, (wall, cpu) in timed.items():
            rows.append({"variant": variant, "batch": batch, "sentences": len(ids), "tokens": steps[variant],
                         "tokens_per_cpu_s": round(steps[variant] / cpu, 1),
                         "tokens_per_s": round(steps[variant] / wall, 1), "rounds": rounds,
                         "load_before": load})  # fmt: skip
        print(rows[-len(timed) :], flush=True)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per batch: ours / CTranslate2 at each precision, and int8 / fp32 per engine (tokens per CPU s; wall)."""
    out = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        at = {r["variant"]: r for r in rows if r["batch"] == batch}

        def ratio(a: str, b: str, at: dict = at) -> str:
            cpu = at[a]["tokens_per_cpu_s"] / at[b]["tokens_per_cpu_s"]
            wall = at[a]["tokens_per_s"] / at[b]["tokens_per_s"]
            return f"{cpu:.2f}× ({wall:.2f}×)"

        out.append({"batch": batch, "ours / CT2, fp32": ratio("ours fp32", "CTranslate2 fp32"),
                    "ours / CT2, int8": ratio("ours int8", "CTranslate2 int8"),
                    "ours int8 / ours fp32": ratio("ours int8", "ours fp32"),
                    "CT2 int8 / CT2 fp32": ratio("CTranslate2 int8", "CTranslate2 fp32"),
                    "ours int8 / CT2 fp32": ratio("ours int8", "CTranslate2 fp32")})  # fmt: skip
        if "ours fp32, new buffers" in at:
            out[-1]["ours fp32 / on new buffers"] = ratio("ours fp32", "ours fp32, new buffers")
    return out


def quality(decoders: dict, ids: list[list[int]], references: list[str], tokenizer: Tokenizer, pad_id: int,
            batch: int = 32) -> list[dict]:  # fmt: skip
    import sacrebleu

    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for variant, decoder in decoders.items():
        started = time.perf_counter()
        found = decode_in_batches(decoder, ids, pad_id, (1, 256), batch)
        seconds[variant], outputs[variant] = time.perf_counter() - started, found

    def identical(a: list[list[int]], b: list[list[int]]) -> str:
        same = sum(x == y for x, y in zip(a, b, strict=True))
        return f"{same}/{len(a)} ({100 * same / len(a):.1f} %)"

    rows = []
    for variant, found in outputs.items():
        hypotheses = [tokenizer.decode(out) for out in found]
        bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
        rows.append({"variant": variant, "sentences": len(ids),
                     "identical_to_ours_fp32": identical(found, outputs["ours fp32"]),
                     "identical_to_ours_int8": identical(found, outputs["ours int8"]),
                     "bleu": f"{bleu.corpus_score(hypotheses, [references]).score:.2f}",
                     "chrf": f"{chrf.corpus_score(hypotheses, [references]).score:.2f}",
                     "seconds": round(seconds[variant], 1), "signature": str(bleu.get_signature())})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = agg_subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(variants)
    for ax, key, label in ((axes[0], "tokens_per_cpu_s", "tokens per CPU second"),
                           (axes[1], "tokens_per_s", "tokens per wall second")):  # fmt: skip
        for v, variant in enumerate(variants):
            values = [next(r[key] for r in rows if r["variant"] == variant and r["batch"] == b) for b in batches]
            ax.bar(np.arange(len(batches)) + (v - (len(variants) - 1) / 2) * width, values, width, label=variant)
        ax.set_xticks(np.arange(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
        ax.set_title(f"greedy decoding, same weights, 1 thread: {label}")
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--bundle", default="translate-transformer", help="fp32 bundle; its int8 twin is <name>-int8")
    parser.add_argument("--ende", type=Path, default=REPO / ".cache/data/ende/test.tsv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--speed-sentences", type=int, default=64, help="first N test sources for speed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quality-limit", type=int, default=0, help="first N test pairs for parity (0: all)")
    parser.add_argument("--new-buffers", action="store_true", help="add ours fp32 on new buffers (module docstring)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ctranslate2-decode")
    args = parser.parse_args(argv)
    load_before = load_average()

    decoders = runtimes(args.models_dir, args.bundle, args.threads, args.new_buffers)
    bundle = load_bundle(args.models_dir / args.bundle)
    tokenizer = Tokenizer.from_bundle(bundle)
    pairs = read_pairs(args.ende)
    ids = [e.ids for e in tokenizer.encode_all([en for en, _ in pairs], truncate=True)]
    speed_rows = speed(decoders, ids[: args.speed_sentences], args.batches, args.rounds, bundle.pad_id)
    limit = args.quality_limit or len(pairs)
    quality_rows = quality(decoders, ids[:limit], [de for _, de in pairs[:limit]], tokenizer, bundle.pad_id)

    stem = args.out
    write_csv(stem.with_name(stem.name + "-speed.csv"), speed_rows)
    write_csv(stem.with_name(stem.name + "-quality.csv"), quality_rows)
    plot(speed_rows, stem.with_suffix(".png"))
    summary = ratios(speed_rows)
    lines = header("Ours vs CTranslate2 on the same weights: greedy decoding speed and parity",
                   ("onnxruntime", "ctranslate2", "numpy", "sacrebleu"), load_before)  # fmt: skip
    lines += [
        f"Model: `{args.bundle}` (vanilla Transformer, d 128, 3+3 layers, vocabulary 8000) and its int8 twin; "
        "CTranslate2 runs the same weights, converted from the bundle's ONNX initializers by "
        "`export/ctranslate2.py` (int8: `compute_type=\"int8\"` at load). Every decoder has 1 thread "
        f"(ORT intra-op 1 and inter-op 1; CTranslate2 intra_threads {args.threads}, inter_threads 1) and runs in "
        "this one process.",
        "",
        "## Ratios (tokens per CPU second; per wall second in brackets)",
        "",
        *markdown_table(summary, {key: key for key in summary[0]}),
        "",
        f"Speed: greedy decoding to EOS (at most 256 tokens) of the first {args.speed_sentences} test sources; batch 1 "
        "is one sentence per call (single stream), larger batches are length-sorted groups; the decoders take "
        f"turns call by call, median of {args.rounds} rounds; tokens = decoder steps including the EOS, each "
        "variant counting its own outputs. Ours includes the service runtime's Python loop (numpy argmax, "
        "cache handling) per step, as served; CTranslate2's loop is C++.",
        "",
        *markdown_table(speed_rows, {"variant": "variant", "batch": "batch", "tokens": "tokens",
                                     "tokens_per_cpu_s": "tokens / CPU s", "tokens_per_s": "tokens / wall s",
                                     "load_before": "load before"}),  # fmt: skip
        "",
        f"![decode speed]({stem.name}.png)",
        "",
        "## Parity and quality (whole test set, greedy, batches of 32)",
        "",
        *markdown_table(quality_rows, {"variant": "variant", "identical_to_ours_fp32": "identical to ours fp32",
                                       "identical_to_ours_int8": "identical to ours int8", "bleu": "BLEU",
                                       "chrf": "chrF", "seconds": "seconds (one pass)"}),  # fmt: skip
        "",
        f"sacrebleu: `{quality_rows[0]['signature']}`",
        "",
    ]
    write_markdown(stem.with_suffix(".md"), lines)


if __name__ == "__main__":
    main()
