"""fp32 vs int8 bundles, both attention kinds: model-level speed and quality cost (a benchmark, not a test).

Each fp32 bundle is quantised at the start by `export.quantize.quantize_bundle` (the code behind
`python -m export quantize`), per-tensor and per-channel, into a scratch directory; all variants then run in
this one process, 1 ONNX Runtime thread each, interleaved, so they share the machine's state:

- classify speed: `session.run` of model.onnx at n tokens, batch 1, random token ids; every round runs each
  variant once (the order rotates), the median over rounds is reported, as CPU time and wall time;
- translate speed: greedy decoding through service/runtime.py's TranslatorRuntime (what /translate runs) of
  the first test sources, batch 1 (one sentence per call) and batch 8 (length-sorted groups of 8, as the
  batcher groups them), the variants taking turns call by call; tokens/s counts every decoder step (the EOS
  included), median over rounds;
- IMDB test accuracy: every review, truncated to n_max, padded into batches as the service pads them
  (benchmarks/classify_eval.py's `bundle_predictions`), and how many labels int8 changes;
- EN-DE BLEU / chrF (sacrebleu, the same metrics as `python -m training translate-eval`) of the whole test set,
  decoded by TranslatorRuntime in length-sorted batches of 32, greedy and beam 4.

    .venv/bin/python -m benchmarks.int8 [--models-dir models] [--out benchmarks/results/int8]

Writes int8-speed.csv, int8-quality.csv, int8.md and int8.png beside --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.classify_eval import bundle_predictions  # noqa: E402
from export.quantize import quantize_bundle  # noqa: E402
from loadtest.flops import linformer_layer_flops, vanilla_layer_flops  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service.bundle import Bundle, load_bundle  # noqa: E402
from service.runtime import ClassifierRuntime, TranslatorRuntime, make_session  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402
from training.classify import read_split_with_source  # noqa: E402
from training.translate import read_pairs  # noqa: E402

CPU = ["CPUExecutionProvider"]
VARIANTS = {"fp32": None, "int8": False, "int8 per-channel": True}  # name -> per_channel (None: the fp32 bundle)


def session(bundle: Bundle, role: str):
    return make_session(bundle.onnx_path(role), CPU, intra_op_threads=1, inter_op_threads=1)


def translator(bundle: Bundle) -> TranslatorRuntime:
    config = bundle.config
    return TranslatorRuntime(
        session(bundle, "encoder"), session(bundle, "decoder"), n_layers=config["n_decoder_layers"],
        n_heads=config["n_heads"], head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"],
        bos_id=bundle.bos_id, eos_id=bundle.eos_id,
        length_penalty_alpha=config.get("export", {}).get("length_penalty_alpha", 0.6),
    )  # fmt: skip


def padded(ids: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    input_ids = np.full((len(ids), max(map(len, ids))), pad_id, np.int64)
    mask = np.zeros_like(input_ids)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    return input_ids, mask


def decode_in_batches(runtime, ids: list[list[int]], pad_id: int, options=(1, 256), batch: int = 32) -> list[list[int]]:
    """Target ids of every source, decoded in length-sorted batches of `batch` (how the benchmarks score a test set)."""
    outputs: list[list[int]] = [[] for _ in ids]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch):
        chosen = order[start : start + batch]
        for i, out in zip(chosen, runtime.run(*padded([ids[i] for i in chosen], pad_id), options), strict=True):
            outputs[i] = out
    return outputs


class Clock:
    """Wall-clock and CPU seconds (this process, every thread) of what runs between start() and stop().

    The machine is shared and oversubscribed (load averages of 7-11 on 2 cores while this ran): a call's
    wall time is mostly how long the scheduler left this process waiting, which moves from one call to the
    next. CPU time counts only the work done, so it compares the two graphs' cost far more steadily; both are
    reported, CPU time first.
    """

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def interleaved(calls: dict[str, callable], rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each call over `rounds`; each round runs every call once, the order rotating."""
    names, clock = list(calls), Clock()
    for name in names:  # warm-up: first runs allocate and pick kernels
        calls[name]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            clock.start()
            calls[name]()
            times[name].append(clock.stop())
    return {name: medians(t) for name, t in times.items()}


def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def classify_speed(model: str, bundles: dict[str, Bundle], lengths: list[int], rounds: int) -> list[dict]:
    runtimes = {variant: ClassifierRuntime(session(b, "model")) for variant, b in bundles.items()}
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        ids = rng.integers(4, bundles["fp32"].config["model_config"]["vocab_size"], (1, n))
        ids[0, 0] = bundles["fp32"].bos_id
        mask = np.ones_like(ids)
        load = load_average()
        timed = interleaved({v: (lambda r=r, ids=ids, mask=mask: r.run(ids, mask)) for v, r in runtimes.items()},
                            rounds)  # fmt: skip
        (fp32_wall, fp32_cpu) = timed["fp32"]
        for variant, (wall, cpu) in timed.items():
            rows.append({"model": model, "variant": variant, "setting": f"n={n}, batch 1", "n": n, "batch": 1,
                         "cpu_ms": round(1000 * cpu, 3), "wall_ms": round(1000 * wall, 3),
                         "speedup_cpu": round(fp32_cpu / cpu, 3), "speedup_wall": round(fp32_wall / wall, 3),
                         "rounds": rounds, "load_before": load})  # fmt: skip
        print(rows[-3:], flush=True)
    return rows


def interleaved_decoding(runtimes: dict[str, TranslatorRuntime], groups: list, rounds: int):
    """Median (wall, CPU) seconds per variant to greedy-decode every group, and the decoder steps it took.

    The variants take turns call by call (the order rotating), not pass by pass: a pass takes seconds, and on a
    shared machine the load moves within seconds, so whole passes back to back would not see the same machine.
    """
    names, clock = list(runtimes), Clock()
    for name in names:  # warm-up
        runtimes[name].run(*groups[0], (1, 256))
    totals: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    steps = dict.fromkeys(names, 0)
    for r in range(rounds):
        spent = {name: (0.0, 0.0) for name in names}
        for g, (input_ids, mask) in enumerate(groups):
            turn = (r + g) % len(names)
            for name in names[turn:] + names[:turn]:
                clock.start()
                outputs = runtimes[name].run(input_ids, mask, (1, 256))
                wall, cpu = clock.stop()
                spent[name] = (spent[name][0] + wall, spent[name][1] + cpu)
                if r == 0:
                    steps[name] += sum(len(out) + 1 for out in outputs)  # + the EOS step (or the cut at 256)
        for name in names:
            totals[name].append(spent[name])
    return {name: medians(t) for name, t in totals.items()}, steps


def dense_flop_share(cfg: dict, n: int) -> float:
    """Share of a layer's matrix-product FLOPs (loadtest/flops.py) in the weight projections and feed-forward."""
    d, d_ff, k = cfg["d_model"], cfg["d_ff"], cfg["k"]
    if cfg["attention"] == "linformer":
        return (4 * n * d * d + 4 * k * d * d + 4 * n * d * d_ff) / linformer_layer_flops(n, d, d_ff, k)
    return (8 * n * d * d + 4 * n * d * d_ff) / vanilla_layer_flops(n, d, d_ff)


def time_shares(model: str, bundle: Bundle, lengths: list[int], runs: int = 11) -> list[dict]:
    """Where an fp32 classifier's `session.run` spends its kernel time (ORT profiler, 1 thread): the fused
    attention, the dense layers (MatMul/Gemm with a weight: what int8 speeds up) and the rest. The dense share f
    bounds what any speedup of the dense layers can give: 1 / (1 - f) (Amdahl)."""
    import json

    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(bundle.onnx_path("model"))).graph
    weights = {init.name for init in graph.initializer}
    dense = {node.name for node in graph.node
             if node.op_type in ("MatMul", "Gemm") and any(name in weights for name in node.input)}  # fmt: skip
    rows = []
    for n in lengths:
        with tempfile.TemporaryDirectory() as scratch:
            options = ort.SessionOptions()
            options.intra_op_num_threads = options.inter_op_num_threads = 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as the service runs it
            options.enable_profiling, options.profile_file_prefix = True, str(Path(scratch) / "profile")
            options.log_severity_level = 3
            profiled = ort.InferenceSession(str(bundle.onnx_path("model")), options, providers=CPU)
            feeds = {"input_ids": np.full((1, n), 5, np.int64), "attention_mask": np.ones((1, n), np.int64)}
            for _ in range(runs):
                profiled.run(None, feeds)
            events = json.loads(Path(profiled.end_profiling()).read_text())
        durations: dict[tuple[str, str], list[int]] = {}
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                key = (event["name"].removesuffix("_kernel_time"), event["args"]["op_name"])
                durations.setdefault(key, []).append(event["dur"])
        spent = {"attention": 0.0, "dense": 0.0, "other": 0.0}
        for (node, op), times in durations.items():  # each node's median over the runs: a preempted run is noise
            kind = "attention" if op == "MultiHeadAttention" else "dense" if node in dense else "other"
            spent[kind] += statistics.median(times)
        total = sum(spent.values())
        rows.append({"model": model, "n": n, **{f"{k}_share": round(v / total, 3) for k, v in spent.items()},
                     "dense_bound": round(total / (total - spent["dense"]), 2),
                     "dense_flop_share": round(dense_flop_share(bundle.config["model_config"], n), 3)})  # fmt: skip
    return rows


def translate_speed(model: str, bundles: dict[str, Bundle], sources: list[str], batches: list[int], rounds: int):
    runtimes = {variant: translator(b) for variant, b in bundles.items()}
    tokenizer = Tokenizer.from_bundle(bundles["fp32"])
    ids = [e.ids for e in tokenizer.encode_all(sources, truncate=True)]
    rows = []
    for batch in batches:
        order = list(range(len(ids))) if batch == 1 else sorted(range(len(ids)), key=lambda i: len(ids[i]))
        groups = [padded([ids[i] for i in order[s : s + batch]], bundles["fp32"].pad_id)
                  for s in range(0, len(order), batch)]  # fmt: skip
        load = load_average()
        timed, steps = interleaved_decoding(runtimes, groups, rounds)
        fp32_wall, fp32_cpu = (steps["fp32"] / seconds for seconds in timed["fp32"])
        for variant, (wall, cpu) in timed.items():
            rows.append({"model": model, "variant": variant, "setting": f"greedy, batch {batch}", "batch": batch,
                         "sentences": len(ids), "tokens": steps[variant],
                         "tokens_per_cpu_s": round(steps[variant] / cpu, 1),
                         "tokens_per_s": round(steps[variant] / wall, 1),
                         "speedup_cpu": round(steps[variant] / cpu / fp32_cpu, 3),
                         "speedup_wall": round(steps[variant] / wall / fp32_wall, 3),
                         "rounds": rounds, "load_before": load})  # fmt: skip
        print(rows[-3:], flush=True)
    return rows


def imdb_quality(model: str, bundles: dict[str, Bundle], test: Path, limit: int = 0) -> list[dict]:
    rows_in = read_split_with_source(test)[: limit or None]
    texts, labels = [t for _, t, _ in rows_in], np.array([y for y, _, _ in rows_in])
    rows, fp32_labels = [], None
    for variant, bundle in bundles.items():
        started = time.perf_counter()
        predicted = (bundle_predictions(bundle.path, texts, threads=1) >= 0.5).astype(int)
        fp32_labels = predicted if fp32_labels is None else fp32_labels
        rows.append({"model": model, "variant": variant, "metric": "IMDB test accuracy (%)",
                     "value": round(100 * float((predicted == labels).mean()), 2),
                     "changed_vs_fp32": f"{int((predicted != fp32_labels).sum())}/{len(texts)} labels",
                     "items": len(texts), "seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def bleu_quality(model: str, bundles: dict[str, Bundle], test: Path, beams: list[int], limit: int = 0, batch: int = 32):
    import sacrebleu

    pairs = read_pairs(test)[: limit or None]
    references = [de for _, de in pairs]
    tokenizer = Tokenizer.from_bundle(bundles["fp32"])
    ids = [e.ids for e in tokenizer.encode_all([en for en, _ in pairs], truncate=True)]
    rows = []
    for beam in beams:
        fp32_hypotheses = None
        for variant, bundle in bundles.items():
            runtime = translator(bundle)
            started = time.perf_counter()
            outputs = decode_in_batches(runtime, ids, bundle.pad_id, (beam, 256), batch)
            hypotheses = [tokenizer.decode(out) for out in outputs]
            seconds = time.perf_counter() - started
            fp32_hypotheses = fp32_hypotheses or hypotheses
            bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
            changed = sum(a != b for a, b in zip(hypotheses, fp32_hypotheses, strict=True))
            for metric, scorer in ((f"BLEU, {'greedy' if beam == 1 else f'beam {beam}'}", bleu),
                                   (f"chrF, {'greedy' if beam == 1 else f'beam {beam}'}", chrf)):  # fmt: skip
                rows.append({"model": model, "variant": variant, "metric": metric,
                             "value": round(scorer.corpus_score(hypotheses, [references]).score, 2),
                             "changed_vs_fp32": f"{changed}/{len(ids)} translations", "items": len(ids),
                             "seconds": round(seconds, 1), "signature": str(scorer.get_signature())})  # fmt: skip
            print(rows[-2:], flush=True)
    return rows


def summary(speed: list[dict], quality: list[dict]) -> list[dict]:
    """One row per model and int8 variant: every speedup, and each metric's change against fp32."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in speed + quality):
        for variant in [v for v in VARIANTS if v != "fp32"]:
            row = {"model": model, "variant": variant}
            for r in speed:
                if r["model"] == model and r["variant"] == variant:
                    row[r["setting"]] = f"{r['speedup_cpu']:.2f}× ({r['speedup_wall']:.2f}×)"
            for r in quality:
                if r["model"] == model and r["variant"] == variant:
                    fp32 = next(q["value"] for q in quality
                                if q["model"] == model and q["metric"] == r["metric"] and q["variant"] == "fp32")
                    row[r["metric"]] = f"{fp32:.2f} → {r['value']:.2f} ({r['value'] - fp32:+.2f})"  # fmt: skip
            rows.append(row)
    return rows


def plot(speed: list[dict], path: Path) -> None:
    fig, (left, right) = agg_subplots(1, 2, figsize=(11, 4.2))
    for model in dict.fromkeys(r["model"] for r in speed if "n" in r and r.get("n")):
        for variant, style in (("int8", "o-"), ("int8 per-channel", "s--")):
            mine = [r for r in speed if r["model"] == model and r["variant"] == variant]
            left.plot([r["n"] for r in mine], [r["speedup_cpu"] for r in mine], style, label=f"{model}, {variant}")
    left.axhline(1.3, color="grey", lw=0.8, ls=":")
    left.axhline(1.0, color="black", lw=0.6)
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens n (batch 1)")
    left.set_ylabel("int8 speedup over fp32 (CPU time of session.run)")
    left.set_title("classify: model level, 1 ORT thread")
    left.legend(fontsize=7)
    translate = [r for r in speed if "tokens_per_cpu_s" in r and r["variant"] != "fp32"]
    labels = list(dict.fromkeys(f"{r['model']}\n{r['setting']}" for r in translate))
    width = 0.38
    for i, (variant, color) in enumerate((("int8", "tab:blue"), ("int8 per-channel", "tab:orange"))):
        chosen = {f"{r['model']}\n{r['setting']}": r["speedup_cpu"] for r in translate if r["variant"] == variant}
        values = [chosen[label] for label in labels]
        right.bar(np.arange(len(labels)) + (i - 0.5) * width, values, width, label=variant, color=color)
    right.axhline(1.3, color="grey", lw=0.8, ls=":")
    right.axhline(1.0, color="black", lw=0.6)
    right.set_xticks(np.arange(len(labels)), labels, fontsize=7)
    right.set_ylabel("int8 speedup over fp32 (tokens per CPU second)")
    right.set_title("translate: greedy decoding, 1 ORT thread")
    right.legend(fontsize=7)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--classify", nargs="*", default=["classify-linformer", "classify-transformer"])
    parser.add_argument("--translate", nargs="*", default=["translate-linformer", "translate-transformer"])
    parser.add_argument("--imdb", type=Path, default=REPO / ".cache/data/imdb/test.tsv")
    parser.add_argument("--ende", type=Path, default=REPO / ".cache/data/ende/test.tsv")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds for classify speed")
    parser.add_argument("--translate-rounds", type=int, default=7)
    parser.add_argument("--speed-sentences", type=int, default=64, help="first N test sources for decode speed")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--beams", type=int, nargs="*", default=[1, 4], help="BLEU with these beam sizes")
    parser.add_argument("--skip-quality", action="store_true", help="speed only")
    parser.add_argument("--quality-limit", type=int, default=0, help="first N test items (0: all); for a smoke run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "int8")
    args = parser.parse_args(argv)
    load_before = load_average()

    speed, quality, sizes, shares = [], [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for model in [*args.classify, *args.translate]:
            fp32 = args.models_dir / model
            bundles = {"fp32": load_bundle(fp32)}
            for variant, per_channel in VARIANTS.items():
                if per_channel is not None:
                    out = Path(scratch) / f"{model}-{variant.replace(' ', '-')}"
                    quantize_bundle(fp32, out, per_channel=per_channel)
                    bundles[variant] = load_bundle(out)
            for variant, bundle in bundles.items():
                onnx_bytes = sum(bundle.onnx_path(role).stat().st_size for role in bundle.onnx_files)
                sizes.append({"model": model, "variant": variant, "onnx_MB": round(onnx_bytes / 1e6, 2)})
            if model in args.classify:
                speed += classify_speed(model, bundles, args.lengths, args.rounds)
                shares += time_shares(model, bundles["fp32"], args.lengths)
                if not args.skip_quality:
                    quality += imdb_quality(model, bundles, args.imdb, args.quality_limit)
            else:
                pairs = read_pairs(args.ende)[: args.speed_sentences]
                speed += translate_speed(model, bundles, [en for en, _ in pairs], args.batches, args.translate_rounds)
                if not args.skip_quality:
                    quality += bleu_quality(model, bundles, args.ende, args.beams, args.quality_limit)

    stem = args.out
    write_csv(stem.with_name(stem.name + "-speed.csv"), speed)
    if quality:
        write_csv(stem.with_name(stem.name + "-quality.csv"), quality)
    plot(speed, stem.with_suffix(".png"))
    table = summary(speed, quality)
    tables = []
    for task_models in (args.classify, args.translate):
        rows = [row for row in table if row["model"] in task_models]
        if rows:
            tables += [*markdown_table(rows, {key: key for key in dict.fromkeys(k for row in rows for k in row)}), ""]
    where = {name: path.relative_to(REPO) if path.is_relative_to(REPO) else path
             for name, path in (("models", args.models_dir), ("imdb", args.imdb), ("ende", args.ende))}  # fmt: skip
    sentences = f"the first {args.quality_limit}" if args.quality_limit else "all"
    lines = header("int8 (ONNX Runtime dynamic quantisation) vs fp32: speed and quality", ("onnxruntime", "onnx",
                   "numpy", "sacrebleu"), load_before)  # fmt: skip
    lines += [
        "Every variant runs in this one process with 1 ONNX Runtime intra-op thread (and 1 inter-op), interleaved "
        "round by round, so they share the machine's state; the machine is shared with other jobs, and the load "
        "average before each measurement is in the CSV (`load_before`). int8 bundles are made at the start by "
        "`export.quantize.quantize_bundle` from the fp32 bundles in "
        f"`{where['models']}`.",
        "",
        "## Summary: int8 speedup over fp32 (model level) and quality change",
        "",
        "Speedups: CPU time (wall clock in brackets). On this oversubscribed machine a call's wall time is mostly "
        "time spent waiting for a core, which changes from call to call; the CPU time this process spent is the "
        "cost of the graph itself, and steadier.",
        "",
        *tables,
        f"- classify speed: `session.run` at batch 1, random token ids, median of {args.rounds} interleaved rounds "
        "(CPU ms and wall ms).",
        f"- translate speed: greedy decoding by TranslatorRuntime of the first {args.speed_sentences} test sources "
        f"(batch 8: length-sorted groups), the variants taking turns call by call; tokens = decoder steps (EOS "
        f"included) per CPU second and per wall second, median of {args.translate_rounds} rounds.",
        f"- quality: {sentences} items of `{where['imdb']}` (`python -m training.imdb`) and `{where['ende']}` "
        "(`python -m training.ende`); translations in batches of 32, beam search with the GNMT length penalty 0.6 "
        "as served; `changed vs fp32` counts labels / translations that differ from the fp32 bundle's.",
        "",
        "## Speed",
        "",
        *markdown_table(speed, {"model": "model", "variant": "variant", "setting": "setting", "cpu_ms": "CPU ms",
                                "wall_ms": "wall ms", "tokens_per_cpu_s": "tokens / CPU s",
                                "tokens_per_s": "tokens / wall s", "speedup_cpu": "speedup (CPU)",
                                "speedup_wall": "speedup (wall)", "load_before": "load before"}),  # fmt: skip
        "",
        f"![int8 speedups]({stem.name}.png)",
        "",
    ]
    if shares:
        lines += ["## Where the fp32 classifiers spend their time", "",
                  "Kernel time of `session.run` by kind (ORT profiler, 1 thread; each node's median over 11 runs "
                  "at a constant token id, so a run that lost the core does not count): the fused "
                  "MultiHeadAttention stays fp32 (dynamic quantisation has no kernel for it), the dense layers "
                  "are what int8 speeds up; `bound` = 1 / (1 - dense share) is the most any speedup of the "
                  "dense layers alone can give. Profiles on a loaded machine move from run to run; the FLOP share "
                  "(matrix products only, `loadtest/flops.py`) is the deterministic view of the same split.", "",
                  *markdown_table(shares, {"model": "model", "n": "n", "attention_share": "attention",
                                           "dense_share": "dense layers", "other_share": "other",
                                           "dense_bound": "bound",
                                           "dense_flop_share": "dense share of FLOPs"}), ""]  # fmt: skip
    if quality:
        lines += ["## Quality", "",
                  *markdown_table(quality, {"model": "model", "variant": "variant", "metric": "metric",
                                            "value": "value", "changed_vs_fp32": "changed vs fp32",
                                            "seconds": "seconds"}), ""]  # fmt: skip
        signatures = sorted({r["signature"] for r in quality if r.get("signature")})
        lines += [f"sacrebleu: {', '.join(f'`{s}`' for s in signatures)}", ""] if signatures else []
    lines += ["## Size of the ONNX files", "", *markdown_table(sizes, {"model": "model", "variant": "variant",
                                                                      "onnx_MB": "MB"}), ""]  # fmt: skip
    write_markdown(stem.with_suffix(".md"), lines)


if __name__ == "__main__":
    main()
