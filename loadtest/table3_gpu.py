"""The paper's Table 3 on a GPU: Linformer and Performer vs vanilla attention in PyTorch on CUDA, where the
paper measured (a V100), beside loadtest/table3.py's ONNX Runtime CPU tables.

    python -m loadtest.table3_gpu                            # paper size, n = 512 ... 8192, k = 128, 256, fp16
    python -m loadtest.table3_gpu --dtype float32 --suffix -x
    python -m loadtest.table3_gpu --device cpu --lengths 64,128 --ks 16 --tokens 256 --reps 2   # a smoke run

The same random-initialised classifiers as loadtest/table3.py (model/linformer.py, its sizes), moved to the
device in --dtype, run under torch.inference_mode. Vanilla attention is measured twice: as the model file calls
it (PyTorch's scaled_dot_product_attention, which picks a fused kernel on CUDA: the memory-efficient one, since
the model passes a padding mask) and with the math backend (the n x n scores materialised, attention as in
2020, the paper's baseline). The Linformer (layerwise sharing, linear E, input compressed first) and the
Performer (FAVOR+) run as the model file has them.

- time: batch = --tokens // n sequences of random token ids, no padding; each round runs every kind once in a
  rotating order, timed with CUDA events; the median per kind, per sequence, is reported.
- peak: extra device memory one batch-1 forward allocates (torch.cuda.max_memory_allocated minus what was
  allocated before it: the weights of all kinds stay loaded).
- max batch: the largest power-of-two batch whose forward's extra memory stays within --budget-gib (16: the
  paper's V100), doubling from 1 up to --max-batch; an out-of-memory error ends the search.

Memory columns are CUDA-only (a --device cpu run leaves them empty). Writes
loadtest/results/table3-gpu-<size>-<dtype><suffix>.{csv,md,png} (--out: another folder). torch is imported
inside functions: locust imports every module in this folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python loadtest/table3_gpu.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.flops import flop_ratio, performer_flop_ratio  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from loadtest.table3 import PAPER_SPEEDUP_K128, RESULTS, SIZES, VOCAB  # noqa: E402

VANILLA, MATH = "vanilla", "vanilla-math"


def build_models(size: str, ks: list[int], n_max: int, n_features: int, device: str, dtype: str) -> dict[str, dict]:
    """label -> {"model", "math": run under the math SDPA backend, "k", "m"}: vanilla twice, Linformer per k,
    Performer; seeded, in eval mode, on the device in dtype."""
    import torch

    from model import Classifier, ModelConfig

    kinds = [(VANILLA, "transformer", None), (MATH, "transformer", None),
             *((f"linformer-k{k}", "linformer", k) for k in ks), ("performer", "performer", None)]  # fmt: skip
    models = {}
    for label, attention, k in kinds:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=VOCAB, n_max=n_max, dropout=0.0, attention=attention, k=k or 128,
                          sharing="layerwise", n_features=n_features, **SIZES[size])  # fmt: skip
        model = Classifier(cfg).eval().to(device=device, dtype=getattr(torch, dtype))
        models[label] = {"model": model, "math": label == MATH, "k": k, "m": cfg.features()}
    return models


def forward(entry: dict, ids, mask):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.inference_mode():
        if entry["math"]:
            with sdpa_kernel(SDPBackend.MATH):
                return entry["model"](ids, mask)
        return entry["model"](ids, mask)


def inputs(n: int, batch: int, device: str, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, n), generator=generator).to(device)
    return ids, torch.ones_like(ids)


def time_models(models: dict[str, dict], n: int, batch: int, device: str, reps: int) -> dict[str, float]:
    """label -> median ms per sequence at this batch, from rounds of one forward per kind in rotating order."""
    import torch

    cuda = device.startswith("cuda")
    ids, mask = inputs(n, batch, device)
    for entry in models.values():  # warm-up: kernel selection, allocator growth
        for _ in range(2):
            forward(entry, ids, mask)
    labels, times = list(models), {label: [] for label in models}
    for r in range(reps):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward(models[label], ids, mask)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                forward(models[label], ids, mask)
                ms = (time.perf_counter() - t0) * 1000
            times[label].append(ms / batch)
    return {label: statistics.median(t) for label, t in times.items()}


def extra_bytes(entry: dict, n: int, batch: int, device: str) -> int | None:
    """Device memory one forward allocates beyond what was allocated before it; None when it does not fit."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        forward(entry, *inputs(n, batch, device))
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()
    return torch.cuda.max_memory_allocated() - before


def largest_batch(entry: dict, n: int, device: str, budget: int, cap: int) -> int:
    best, batch = 0, 1
    while batch <= cap:
        used = extra_bytes(entry, n, batch, device)
        if used is None or used > budget:
            break
        best, batch = batch, batch * 2
    return best


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    models = build_models(args.size, args.ks, max(args.lengths), args.n_features, args.device, args.dtype)
    cuda = args.device.startswith("cuda")
    d, d_ff, heads = SIZES[args.size]["d_model"], SIZES[args.size]["d_ff"], SIZES[args.size]["n_heads"]
    m = models["performer"]["m"]
    rows = []
    for n in args.lengths:
        batch = max(1, args.tokens // n)
        ms = time_models(models, n, batch, args.device, args.reps)
        peak, most, budget = {}, {}, int(args.budget_gib * 2**30)
        for label, entry in models.items():
            used = extra_bytes(entry, n, 1, args.device) if cuda else None
            peak[label] = None if used is None else used / 2**20
            most[label] = largest_batch(entry, n, args.device, budget, args.max_batch) if cuda else None

        def ratio(a, b, digits=2):
            return round(a / b, digits) if a and b else None

        for k in args.ks:
            lin = f"linformer-k{k}"
            rows.append({
                "size": args.size, "dtype": args.dtype, "n": n, "k": k, "m": m, "batch": batch,
                "vanilla_ms": round(ms[VANILLA], 4), "vanilla_math_ms": round(ms[MATH], 4),
                "linformer_ms": round(ms[lin], 4), "performer_ms": round(ms["performer"], 4),
                "speedup": ratio(ms[VANILLA], ms[lin]), "speedup_vs_math": ratio(ms[MATH], ms[lin]),
                "performer_speedup": ratio(ms[VANILLA], ms["performer"]),
                "performer_speedup_vs_math": ratio(ms[MATH], ms["performer"]),
                "paper_speedup": PAPER_SPEEDUP_K128.get(n) if k == 128 else None,
                "flop_ratio": round(flop_ratio(n, d, d_ff, k), 2),
                "performer_flop_ratio": round(performer_flop_ratio(n, d, d_ff, m, heads), 2),
                **{f"{name}_peak_mib": None if peak[label] is None else round(peak[label], 1)
                   for name, label in (("vanilla", VANILLA), ("vanilla_math", MATH), ("linformer", lin),
                                       ("performer", "performer"))},
                "memory_saving": ratio(peak[VANILLA], peak[lin]), "memory_saving_vs_math": ratio(peak[MATH], peak[lin]),
                "performer_memory_saving_vs_math": ratio(peak[MATH], peak["performer"]),
                "vanilla_max_batch": most[VANILLA], "vanilla_math_max_batch": most[MATH],
                "linformer_max_batch": most[lin], "performer_max_batch": most["performer"],
                "reps": args.reps,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows, models


def device_line(device: str) -> str:
    import torch

    if not device.startswith("cuda"):
        return f"- device: {device} (no memory columns), torch {torch.__version__}"
    p = torch.cuda.get_device_properties(device)
    return (f"- device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")  # fmt: skip


def write_report(args: argparse.Namespace, rows: list[dict], models: dict, load_before: str) -> Path:
    stem = args.out / f"table3-gpu-{args.size}-{args.dtype}{args.suffix}"
    write_csv(stem.with_suffix(".csv"), rows)
    s, k0, m = SIZES[args.size], args.ks[0], models["performer"]["m"]
    lines = header(f"Table 3 on a GPU ({args.size} size, {args.dtype}): Linformer and Performer vs vanilla in PyTorch",
                   ("torch", "numpy"), load_before)  # fmt: skip
    lines.insert(len(lines) - 1, device_line(args.device))  # after the versions, before the blank line
    budget = f"{args.budget_gib:g} GiB"
    lines += [
        f"Models: random-initialised classifiers, d_model {s['d_model']}, {s['n_heads']} heads, {s['n_layers']} "
        f"layers, d_ff {s['d_ff']}, vocabulary {VOCAB}, n_max {max(args.lengths)}, in {args.dtype} under "
        "torch.inference_mode (model/linformer.py as trained and exported). Linformer: layerwise sharing, learned "
        f"linear E, input compressed first, k = {', '.join(map(str, args.ks))}. Performer: FAVOR+, M = {m}. "
        "Vanilla twice: **fused** = scaled_dot_product_attention as the model file calls it (on CUDA a fused "
        "kernel; with the padding mask the model passes, the memory-efficient one, never the n x n scores in "
        "memory), **math** = the same call under the math backend (the scores materialised: attention as the "
        "paper's 2020 baseline ran it).",
        "",
        f"Time: batch = {args.tokens} // n sequences, random ids, no padding; {args.reps} rounds of every kind once "
        "in rotating order (CUDA events), the median per sequence. Peak: extra memory of one batch-1 forward. Max "
        f"batch: the largest power of two whose forward needs at most {budget} beyond the weights (the paper's "
        f"V100 had 16 GiB), up to {args.max_batch}. Paper: Wang et al. 2020, Table 3 (V100, their model, k = 128).",
        "",
        "## Speed (time per sequence)",
        "",
        *markdown_table(rows, {
            "n": "n", "k": "k", "batch": "batch", "vanilla_ms": "vanilla fused ms",
            "vanilla_math_ms": "vanilla math ms", "linformer_ms": "Linformer ms",
            "performer_ms": f"Performer ms (M {m})",
            "speedup": "Linformer / fused", "speedup_vs_math": "Linformer / math",
            "paper_speedup": "paper (V100)", "flop_ratio": "FLOP bound",
            "performer_speedup": "Performer / fused", "performer_speedup_vs_math": "Performer / math",
        }),  # fmt: skip
        "",
        "## Memory",
        "",
        *markdown_table(rows, {
            "n": "n", "k": "k", "vanilla_peak_mib": "vanilla fused peak MiB",
            "vanilla_math_peak_mib": "vanilla math peak MiB", "linformer_peak_mib": "Linformer peak MiB",
            "performer_peak_mib": "Performer peak MiB", "memory_saving": "Linformer saving / fused",
            "memory_saving_vs_math": "Linformer saving / math",
            "performer_memory_saving_vs_math": "Performer saving / math",
            "vanilla_max_batch": f"fused max batch ({budget})", "vanilla_math_max_batch": "math max batch",
            "linformer_max_batch": "Linformer max batch", "performer_max_batch": "Performer max batch",
        }),  # fmt: skip
        "",
        f"![speedup and memory saving vs n]({stem.name}.png)",
        "",
    ]
    write_markdown(stem.with_suffix(".md"), lines, echo=False)
    plot(rows, k0, m, stem.with_suffix(".png"), args)
    return stem


def plot(rows: list[dict], k0: int, m: int, path: Path, args: argparse.Namespace) -> None:
    fig, (left, right) = agg_subplots(1, 2, figsize=(11, 4.2))
    sub = [r for r in rows if r["k"] == k0]
    ns = [r["n"] for r in sub]
    for key, style, label in (("speedup_vs_math", "o-", f"Linformer k={k0} / vanilla math"),
                              ("speedup", "o--", f"Linformer k={k0} / vanilla fused"),
                              ("performer_speedup_vs_math", "^-", f"Performer M={m} / vanilla math"),
                              ("performer_speedup", "^--", f"Performer M={m} / vanilla fused")):  # fmt: skip
        left.plot(ns, [r[key] for r in sub], style, label=label)
    left.plot(*zip(*sorted(PAPER_SPEEDUP_K128.items()), strict=True), "s:", color="grey", label="paper (V100), k=128")
    for key, style, label in (("memory_saving_vs_math", "o-", f"Linformer k={k0} / vanilla math"),
                              ("memory_saving", "o--", f"Linformer k={k0} / vanilla fused"),
                              ("performer_memory_saving_vs_math", "^-", f"Performer M={m} / math")):  # fmt: skip
        points = [(r["n"], r[key]) for r in sub if r[key]]
        if points:
            right.plot(*zip(*points, strict=True), style, label=label)
    for ax, title in ((left, "time per sequence: vanilla / other"), (right, "peak memory at batch 1: vanilla / other")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_lines():  # a CPU run has no memory figures
            ax.legend(fontsize=8)
    fig.suptitle(f"Table 3 on {args.device} ({args.size} size, {args.dtype})")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m loadtest.table3_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="paper")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--ks", default="128,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--n-features", type=int, default=0, help="the Performer's M (default as model/linformer.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per timed batch (batch = tokens // n)")
    parser.add_argument("--reps", type=int, default=10, help="interleaved rounds per length")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="memory budget of the max-batch search")
    parser.add_argument("--max-batch", type=int, default=4096)
    parser.add_argument("--suffix", default="", help="appended to the results' file names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files")
    args = parser.parse_args(argv)
    load_before = load_average()
    rows, models = measure(args)
    stem = write_report(args, rows, models, load_before)
    print(f"wrote {stem}.{{csv,md,png}}")
    return stem


if __name__ == "__main__":
    main()
