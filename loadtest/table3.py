"""The paper's Table 3 at model level: Linformer and Performer vs vanilla inference time and memory,
random inputs, all three kinds in one run.

    python -m loadtest.table3                         # served size, n = 512 ... 8192, k = 128, 256
    python -m loadtest.table3 --projection mean --ks 128   # the served classifier's mean-pooling E
    python -m loadtest.table3 --size paper --lengths 512,1024,2048,4096,8192 --reps 3

For each size, random-initialised classifiers (vanilla, Linformer with layerwise sharing per k, and
Performer with M random features) are exported with export.classify.export_onnx, the function that
makes the served bundles: ORT's fused com.microsoft MultiHeadAttention for the two softmax kinds,
plain ops for FAVOR+, then ORT's bert optimiser. All are exported at n_max = the longest n, so E is
k x n_max and sliced to n inside the graph, as when serving. All sessions are made by
service.runtime.make_session with the same thread counts and optimisation level (ORT_ENABLE_ALL).

- time: batch 1, random token ids, one process; each round runs every model once in a rotating
  order (A B C, B C A, ...), and the median per model is reported. Rounds stop at --reps, or at
  --min-reps once --seconds-per-length is spent.
- peak memory: a fresh subprocess per (model, n) loads the session, resets the kernel's high-water
  mark (/proc/self/clear_refs), runs batch 1 once and reports VmHWM minus the RSS before the run:
  the working memory of one inference beyond the loaded model. A guard limits the address space to
  60 % of MemAvailable so a shared machine's other jobs survive; a cell over it reads "–".
- largest batch in a budget: subprocesses with an address-space limit (RLIMIT_AS) of the loaded
  session's size plus --budget-gib; the batch starts at the budget over the batch-1 peak (rounded
  down to a power of two) and doubles until a run fails, exceeds the budget or --probe-seconds,
  or halves until one fits.

Writes loadtest/results/table3-<size>.{csv,md,png}. Exported models are cached in loadtest/.cache/.
Heavy imports (torch, onnxruntime, matplotlib) stay inside functions: locust imports this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python loadtest/table3.py`, or imported by `locust -f loadtest/`
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

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache" / "table3"

SIZES = {  # served: what the classify bundles use; paper: close to the paper's base-size ratio
    "served": {"d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 512},
    "paper": {"d_model": 256, "n_heads": 4, "n_layers": 4, "d_ff": 1024},
}
VOCAB = 8000
GUARD_FAILED = "0 (batch 1 over the guard)"
# Wang et al. 2020, Table 3 (V100, inference time speed-up over the Transformer, k = 128).
PAPER_SPEEDUP_K128 = {512: 1.5, 1024: 1.7, 2048: 2.6, 4096: 3.4, 8192: 5.5}


# ---- models ----


def export_models(size: str, ks: list[int], n_max: int, projection: str, n_features: int) -> dict[str, dict]:
    """label -> {"path", "fused", "k", "attention"}; cached by size, kind, k or M, projection and n_max
    (delete loadtest/.cache/ after changing the export)."""
    import torch

    from export.classify import export_onnx
    from model import Classifier, ModelConfig

    performer = ModelConfig(attention="performer", n_features=n_features, **SIZES[size])
    kinds = [("vanilla", "transformer", None, ""), *((f"linformer-k{k}", "linformer", k, "-" + projection) for k in ks),
             ("performer", "performer", None, f"-m{performer.features()}")]  # fmt: skip
    models = {}
    for label, attention, k, variant in kinds:
        path = CACHE / f"{size}-{label}{variant}-nmax{n_max}.onnx"
        meta = path.with_suffix(".json")
        if not (path.exists() and meta.exists()):
            CACHE.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(0)
            cfg = ModelConfig(
                vocab_size=VOCAB, n_max=n_max, dropout=0.0, attention=attention, k=k or 128, sharing="layerwise",
                projection=projection, n_features=n_features, **SIZES[size],
            )  # fmt: skip
            started = time.perf_counter()
            fused = export_onnx(Classifier(cfg).eval(), path)
            meta.write_text(json.dumps({"fused": fused, "export_s": time.perf_counter() - started}))
        models[label] = {"path": path, "fused": json.loads(meta.read_text())["fused"], "k": k, "attention": attention,
                         "m": performer.features() if attention == "performer" else None}  # fmt: skip
    return models


def random_feeds(n: int, batch: int, seed: int = 0, vocab: int = VOCAB) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab, size=(batch, n), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def session(path: Path, threads: int):
    from service.runtime import CPU, make_session

    return make_session(path, [CPU], intra_op_threads=threads, inter_op_threads=1)


# ---- time ----


def time_models(
    models: dict[str, dict], n: int, threads: int, reps: int, min_reps: int, budget_s: float, vocab: int = VOCAB
) -> dict:
    """label -> {"ms": median wall time, "cpu_ms": median CPU time of this thread, "runs": count}, from rounds
    of one run per model in rotating order. With one intra-op thread ORT computes in the calling thread, so
    its CPU time leaves out the time other jobs of a shared machine take the core away."""
    sessions = {label: session(m["path"], threads) for label, m in models.items()}
    feeds = random_feeds(n, 1, vocab=vocab)
    for s in sessions.values():  # warm-up: first-run allocations and kernel selection
        s.run(None, feeds)
    labels, times, cpu = list(sessions), {label: [] for label in sessions}, {label: [] for label in sessions}
    started = time.perf_counter()
    for r in range(reps):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            sessions[label].run(None, feeds)
            times[label].append(time.perf_counter() - t0)
            cpu[label].append(time.thread_time() - c0)
        if r + 1 >= min_reps and time.perf_counter() - started > budget_s:
            break
    return {
        label: {"ms": statistics.median(t) * 1000, "cpu_ms": statistics.median(cpu[label]) * 1000, "runs": len(t)}
        for label, t in times.items()
    }


# ---- memory (each measurement in a fresh process) ----


def _status(field: str) -> int:
    """/proc/self/status field in bytes (VmRSS, VmHWM, VmSize)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def probe(model: Path, n: int, batch: int, threads: int, budget_bytes: int | None) -> dict:
    """Run once in this process (a fresh one): peak RSS over the loaded session, success, seconds."""
    import resource

    s = session(model, threads)
    feeds = random_feeds(n, batch)
    rss_before = _status("VmRSS")
    if budget_bytes is None:  # batch-1 peak: unbounded but for a guard that keeps the machine's jobs alive
        budget_bytes = int(0.6 * _meminfo("MemAvailable"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + budget_bytes, hard))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    started = time.perf_counter()
    try:
        s.run(None, feeds)
        ok, error = True, None
    except Exception as e:  # ORT reports a failed allocation as a RuntimeException
        ok, error = False, str(e)[:200]
    return {"ok": ok, "error": error, "seconds": time.perf_counter() - started,
            "peak_bytes": _status("VmHWM") - rss_before}  # fmt: skip


def run_probe(model: Path, n: int, batch: int, threads: int, budget_bytes: int | None, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "loadtest.table3", "probe", str(model), str(n), str(batch), str(threads)]
    if budget_bytes is not None:
        command.append(str(budget_bytes))
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "timeout": True}
    if done.returncode != 0 or not done.stdout.strip():
        return {"ok": False, "error": (done.stderr or f"exit {done.returncode}")[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_batch(model: Path, n: int, threads: int, budget: int, peak1: int, timeout_s: float, cap: int) -> str:
    """The largest batch whose run succeeds under the budget, as a string: "64", ">=128 (time cap)",
    "0" when not even batch 1 fits."""

    def fits(batch: int) -> bool | None:  # None: took too long to tell
        result = run_probe(model, n, batch, threads, budget, timeout_s)
        if result.get("timeout"):
            return None
        return bool(result["ok"]) and result["peak_bytes"] <= budget

    batch = min(cap, 2 ** max(0, int(math.log2(max(1, budget // max(peak1, 1))))))
    verdict = fits(batch)
    if verdict is None:
        return f">={batch // 2 or 1} (time cap)" if batch > 1 else "? (time cap)"
    if verdict:
        while batch < cap:
            verdict = fits(batch * 2)
            if verdict is None:
                return f">={batch} (time cap)"
            if not verdict:
                return str(batch)
            batch *= 2
        return f">={batch} (batch cap)"
    while batch > 1:
        batch //= 2
        if fits(batch):
            return str(batch)
    return "0"


# ---- report ----


def measure(args: argparse.Namespace, size: str) -> tuple[list[dict], dict]:
    lengths, ks = args.lengths, args.ks
    models = export_models(size, ks, max(lengths), args.projection, args.n_features)
    for label, m in models.items():  # softmax attention in ORT's fused kernel; FAVOR+ has none to fuse
        mha = m["fused"].get("MultiHeadAttention", 0)
        expected = 0 if m["attention"] == "performer" else SIZES[size]["n_layers"]
        assert mha == expected, f"{label}: {mha} fused MultiHeadAttention nodes, {m['fused']}"
    d, d_ff, heads = SIZES[size]["d_model"], SIZES[size]["d_ff"], SIZES[size]["n_heads"]
    m_features = models["performer"]["m"]
    budget = int(args.budget_gib * 2**30)
    rows = []
    for n in lengths:
        timing = time_models(models, n, args.threads, args.reps, args.min_reps, args.seconds_per_length)
        memory = {}
        for label, m in models.items():
            one = run_probe(m["path"], n, 1, args.threads, None, args.probe_seconds * 4)
            peak1 = one.get("peak_bytes") if one.get("ok") else None
            batch = "–" if one.get("timeout") else GUARD_FAILED  # the guard is far above any budget we use
            if peak1 is not None and args.skip_batch_search:
                batch = "not searched"
            if peak1 is not None and not args.skip_batch_search:
                batch = largest_batch(m["path"], n, args.threads, budget, peak1, args.probe_seconds, args.max_batch)
            memory[label] = {"peak_mib": None if peak1 is None else peak1 / 2**20, "batch": batch}
        vanilla, performer = timing["vanilla"], timing["performer"]
        v_mem, p_mem = memory["vanilla"]["peak_mib"], memory["performer"]["peak_mib"]
        for k in ks:
            label = f"linformer-k{k}"
            lin = timing[label]
            l_mem = memory[label]["peak_mib"]
            rows.append({
                "size": size, "n": n, "k": k,
                "vanilla_ms": round(vanilla["ms"], 2), "linformer_ms": round(lin["ms"], 2),
                "speedup": round(vanilla["ms"] / lin["ms"], 3),
                "paper_speedup": PAPER_SPEEDUP_K128.get(n) if k == 128 else None,
                "flop_ratio": round(flop_ratio(n, d, d_ff, k), 3),
                "flop_ratio_paper_order": round(flop_ratio(n, d, d_ff, k, input_first=False), 3),
                "vanilla_peak_mib": None if v_mem is None else round(v_mem, 1),
                "linformer_peak_mib": None if l_mem is None else round(l_mem, 1),
                "memory_saving": None if not (v_mem and l_mem) else round(v_mem / l_mem, 2),
                "vanilla_max_batch": memory["vanilla"]["batch"], "linformer_max_batch": memory[label]["batch"],
                "m": m_features, "performer_ms": round(performer["ms"], 2),
                "performer_speedup": round(vanilla["ms"] / performer["ms"], 3),
                "performer_flop_ratio": round(performer_flop_ratio(n, d, d_ff, m_features, heads), 3),
                "performer_peak_mib": None if p_mem is None else round(p_mem, 1),
                "performer_memory_saving": None if not (v_mem and p_mem) else round(v_mem / p_mem, 2),
                "performer_max_batch": memory["performer"]["batch"],
                "vanilla_cpu_ms": round(vanilla["cpu_ms"], 2), "linformer_cpu_ms": round(lin["cpu_ms"], 2),
                "performer_cpu_ms": round(performer["cpu_ms"], 2),
                "cpu_speedup": round(vanilla["cpu_ms"] / lin["cpu_ms"], 3),
                "performer_cpu_speedup": round(vanilla["cpu_ms"] / performer["cpu_ms"], 3),
                "runs": min(vanilla["runs"], lin["runs"], performer["runs"]),
                "load_average_1min": round(os.getloadavg()[0], 2),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows, models


def write_report(args: argparse.Namespace, size: str, rows: list[dict], models: dict, load_before: str) -> None:
    stem = RESULTS / (stem_name(size, args.projection) + args.suffix)
    write_csv(stem.with_suffix(".csv"), rows)
    s = SIZES[size]
    lines = header(f"Table 3 at model level ({size} size): Linformer and Performer vs vanilla on ONNX Runtime CPU",
                   ("onnxruntime", "torch", "onnx", "numpy"), load_before)  # fmt: skip
    m_features = models["performer"]["m"]
    lines += [
        f"Models: random-initialised classifiers, d_model {s['d_model']}, {s['n_heads']} heads, "
        f"{s['n_layers']} layers, d_ff {s['d_ff']}, vocabulary {VOCAB}; Linformer with layerwise sharing "
        f"(one E for K and V in every layer, input compressed first), k = {', '.join(map(str, args.ks))}, "
        + ("a learned linear E (the paper's). " if args.projection == "linear" else
           f"{args.projection} pooling over windows of n_max/k positions (as the served classifier). ")
        + f"Performer (FAVOR+) with M = {m_features} positive orthogonal random features per head, padded keys "
        "left out (model/linformer.py). "
        + f"Exported with `export.classify.export_onnx` at n_max = {max(args.lengths)} (E sliced to n in the graph).",
        "",
        "Fused operators (ORT optimiser statistics): "
        + "; ".join(f"{label}: {m['fused']}" for label, m in models.items())
        + ". Vanilla and Linformer run attention in ORT's com.microsoft MultiHeadAttention kernel: the vanilla "
        "baseline is ORT's fastest CPU attention, not a naive MatMul-Softmax-MatMul graph. ORT has no kernel for "
        "FAVOR+: the Performer runs as the plain MatMul, Softmax (its queries' features), Exp and ReduceMax nodes "
        "of its exported graph.",
        "",
        f"Runtime: ONNX Runtime CPU, {args.threads} intra-op thread(s), 1 inter-op thread, ORT_ENABLE_ALL, "
        f"same settings for all (service.runtime.make_session). Batch 1, random token ids, no padding. "
        f"Time: median of up to {args.reps} interleaved rounds (at least {args.min_reps}; rounds stop after "
        f"{args.seconds_per_length:g} s per length). Peak: VmHWM minus RSS before the run, batch 1, fresh "
        f"process per cell. Max batch: largest batch that ran with an address-space limit of the loaded "
        f"session plus {args.budget_gib:g} GiB and a peak under it (doubling/halving from the batch-1 estimate; "
        f"{args.probe_seconds:g} s per probe, batches up to {args.max_batch}).",
        "",
        "FLOP bound: vanilla FLOPs over Linformer FLOPs per layer (loadtest/flops.py): 'ours' for the input-first "
        "projection this model uses, 'paper order' for E·(X·Wk); for the Performer, vanilla FLOPs over FAVOR+ FLOPs "
        "counted the same way (matrix products only). Paper: Wang et al. 2020, Table 3 "
        "(V100, their model size), k = 128 only — the k = 256 column could not be looked up here.",
        "",
    ]
    k0 = args.ks[0]
    three = {
        "n": "n", "vanilla_ms": "vanilla ms", "linformer_ms": f"Linformer ms (k {k0})",
        "performer_ms": f"Performer ms (M {m_features})", "speedup": "Linformer speedup",
        "flop_ratio": "Linformer FLOP bound", "performer_speedup": "Performer speedup",
        "performer_flop_ratio": "Performer FLOP bound", "vanilla_peak_mib": "vanilla peak MiB",
        "linformer_peak_mib": "Linformer peak MiB", "performer_peak_mib": "Performer peak MiB",
        "memory_saving": "Linformer memory saving", "performer_memory_saving": "Performer memory saving",
        "vanilla_max_batch": f"vanilla max batch ({args.budget_gib:g} GiB)",
        "linformer_max_batch": "Linformer max batch", "performer_max_batch": "Performer max batch",
        "load_average_1min": "load (1 min)",
    }  # fmt: skip
    cpu = {
        "n": "n", "vanilla_cpu_ms": "vanilla CPU ms", "linformer_cpu_ms": "Linformer CPU ms",
        "performer_cpu_ms": "Performer CPU ms", "cpu_speedup": "Linformer speedup (CPU)",
        "flop_ratio": "Linformer FLOP bound", "performer_cpu_speedup": "Performer speedup (CPU)",
        "performer_flop_ratio": "Performer FLOP bound", "load_average_1min": "load (1 min)",
    }  # fmt: skip
    lines += [f"## All three kinds (k = {k0}, M = {m_features})", "",
              "Wall-clock medians, as in every Table 3 of this project:", "",
              *markdown_table([r for r in rows if r["k"] == k0], three), "",
              "The same runs by CPU time of the thread that ran them (ORT computes in the calling thread at one "
              "intra-op thread): on a shared machine, wall time also counts the time other jobs hold the core, "
              "which does not hit every model alike; CPU time leaves that out (not cache or memory-bandwidth "
              "contention).", "",
              *markdown_table([r for r in rows if r["k"] == k0], cpu), ""]  # fmt: skip
    columns = {
        "n": "n", "k": "k", "vanilla_ms": "vanilla ms", "linformer_ms": "Linformer ms", "speedup": "speedup",
        "paper_speedup": "paper speedup (V100)", "flop_ratio": "FLOP bound (ours)",
        "flop_ratio_paper_order": "FLOP bound (paper order)", "vanilla_peak_mib": "vanilla peak MiB",
        "linformer_peak_mib": "Linformer peak MiB", "memory_saving": "memory saving",
        "vanilla_max_batch": f"vanilla max batch ({args.budget_gib:g} GiB)",
        "linformer_max_batch": f"Linformer max batch ({args.budget_gib:g} GiB)", "runs": "runs",
        "load_average_1min": "load (1 min)",
    }  # fmt: skip
    for k in args.ks:
        lines += [f"## k = {k}", "", *markdown_table([r for r in rows if r["k"] == k], columns), ""]
    batches = ("vanilla_max_batch", "linformer_max_batch", "performer_max_batch")
    if any(r[name] == GUARD_FAILED for r in rows for name in batches):
        lines += [
            f'"{GUARD_FAILED}": the batch-1 run did not fit the memory guard of the peak probe (address space '
            "limited to 60 % of the memory available at the time, so that the machine's other jobs survive): its "
            f"peak is above that guard, far above the {args.budget_gib:g} GiB budget, and is not reported.",
            "",
        ]
    lines += [
        "Caveats: on a shared 2-core machine absolute times are noisy (load average above and per row; "
        "other jobs there run at idle priority); interleaving and medians keep the ratios fairer than the absolutes. "
        "The paper measured a larger model on a V100 GPU; the ratios, not the milliseconds, are comparable.",
        "",
        f"![speedup and memory saving vs n]({stem.name}.png)",
        "",
    ]
    write_markdown(stem.with_suffix(".md"), lines, echo=False)
    plot(rows, args.ks, stem.with_suffix(".png"), size, m_features)


def stem_name(size: str, projection: str) -> str:
    return f"table3-{size}" if projection == "linear" else f"table3-{size}-{projection}"


def plot(rows: list[dict], ks: list[int], path: Path, size: str, m_features: int) -> None:
    fig, (left, right) = agg_subplots(1, 2, figsize=(11, 4.2))
    for k in ks:
        sub = [r for r in rows if r["k"] == k]
        ns = [r["n"] for r in sub]
        left.plot(ns, [r["speedup"] for r in sub], "o-", label=f"Linformer, k={k}")
        left.plot(ns, [r["flop_ratio"] for r in sub], ":", label=f"FLOP bound, Linformer k={k}")
        saving = [(r["n"], r["memory_saving"]) for r in sub if r["memory_saving"]]
        if saving:
            right.plot(*zip(*saving, strict=True), "o-", label=f"Linformer, k={k}")
    sub = [r for r in rows if r["k"] == ks[0]]
    ns = [r["n"] for r in sub]
    left.plot(ns, [r["performer_speedup"] for r in sub], "^-", color="tab:red", label=f"Performer, M={m_features}")
    left.plot(ns, [r["performer_flop_ratio"] for r in sub], ":", color="tab:red", label="FLOP bound, Performer")
    saving = [(r["n"], r["performer_memory_saving"]) for r in sub if r["performer_memory_saving"]]
    if saving:
        right.plot(*zip(*saving, strict=True), "^-", color="tab:red", label=f"Performer, M={m_features}")
    paper = sorted(PAPER_SPEEDUP_K128.items())
    left.plot(*zip(*paper, strict=True), "s--", color="grey", label="paper (V100), k=128")
    for ax, title in ((left, "time: vanilla / other"), (right, "peak memory at batch 1: vanilla / other")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("speedup (x)")
    right.set_ylabel("memory saving (x)")
    fig.suptitle(f"Linformer and Performer vs vanilla, ONNX Runtime CPU, {size} size, batch 1")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:  # internal: one memory measurement in this fresh process
        model, n, batch, threads, *budget = argv[1:]
        print(json.dumps(probe(Path(model), int(n), int(batch), int(threads), int(budget[0]) if budget else None)))
        return
    if argv[:1] == ["time"]:  # internal: batch-1 medians of models in rotating rounds (used by loadtest.sweep)
        n, threads, seconds, vocab, *paths = argv[1:]
        models = {path: {"path": Path(path)} for path in paths}
        print(json.dumps(time_models(models, int(n), int(threads), 10_000, 20, float(seconds), int(vocab))))
        return
    parser = argparse.ArgumentParser(prog="python -m loadtest.table3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=[*SIZES, "both"], default="served")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--ks", default="128,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--projection", choices=["linear", "mean"], default="linear",
                        help="the Linformer's E: linear (the paper's Table 3) or mean pooling")
    parser.add_argument("--n-features", type=int, default=0,
                        help="the Performer's M (default d_head ln d_head in whole blocks of d_head)")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, all kinds (default 1)")
    parser.add_argument("--reps", type=int, default=9, help="interleaved rounds per length, at most")
    parser.add_argument("--min-reps", type=int, default=3)
    parser.add_argument("--seconds-per-length", type=float, default=90, help="stop rounds after this, >= min-reps")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="memory budget of the max-batch search")
    parser.add_argument("--probe-seconds", type=float, default=60, help="time cap of one max-batch probe")
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--skip-batch-search", action="store_true")
    parser.add_argument("--suffix", default="", help="appended to the results' file names (a repeat beside a run)")
    args = parser.parse_args(argv)
    for size in SIZES if args.size == "both" else [args.size]:
        load_before = load_average()
        rows, models = measure(args, size)
        write_report(args, size, rows, models, load_before)
        print(f"wrote {RESULTS / (stem_name(size, args.projection) + args.suffix)}.{{csv,md,png}}")


if __name__ == "__main__":
    main()
