"""Paper Figure 3 at our scale: validation MLM perplexity against updates, Transformer vs Linformer (not a test).

Reads what `python -m training pretrain --eval-every N` logged (runs/<run>/metrics.jsonl: dev perplexity on
the same fixed validation masks at every N steps) and writes benchmarks/results/pretrain.{csv,md,png}: the
curves, and a table at equal updates with each Linformer's perplexity as a ratio of the Transformer's.

    python benchmarks/pretrain_results.py runs/pretrain-transformer runs/pretrain-linformer-k128 ...

The first run named is the reference (the Transformer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)


def describe(cfg: dict) -> str:
    if cfg["attention"] != "linformer":
        return "Transformer"
    windows = ""
    if cfg["projection"] != "linear":
        windows = f", {cfg['projection']} over {cfg['n_max'] // cfg['k']}-token windows"
    return f"Linformer k={cfg['k']} (n_max {cfg['n_max']}{windows})"


def read_run(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {}
    for record in records:
        if "dev_perplexity" in record:
            curve[record["step"]] = record["dev_perplexity"]  # the epoch-end record repeats the last step
    checkpoint = run / "summary.json"
    summary = json.loads(checkpoint.read_text()) if checkpoint.exists() else None
    saved = summary or _configs_from_checkpoint(run)
    config, train = saved["model_config"], saved["train_config"]
    elapsed = max((r.get("elapsed_s", 0) for r in records), default=0)
    return {"run": run.name, "label": describe(config), "curve": curve, "train": train, "minutes": elapsed / 60,
            "finished": summary is not None, "data": (summary or {}).get("data"),
            "where": _where(train, summary)}  # fmt: skip


def _where(train: dict, summary: dict | None) -> str:
    """Where a run trained: its device (the summary names a GPU), or its CPU threads."""
    device = (summary or {}).get("device") or train.get("device", "cpu")
    if device != "cpu":
        return f"{device}, {train.get('threads') or 'default'} CPU threads for its batches"
    return f"{train.get('threads') or 'default'} CPU thread(s)"


def _configs_from_checkpoint(run: Path) -> dict:
    import torch

    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    return {"model_config": saved["model_config"], "train_config": saved["train_config"]}


def unigram_perplexity(data_dir: Path) -> float:
    """What a model that ignores the context scores: training-set token frequencies (add-one) on validation."""
    import numpy as np

    train, dev = np.load(data_dir / "train.ids.npy"), np.load(data_dir / "dev.ids.npy")
    counts = np.bincount(train, minlength=int(max(train.max(), dev.max())) + 1).astype(float) + 1
    return float(np.exp(-np.log(counts[dev] / counts.sum()).mean()))


def plot(runs: list[dict], path: Path, floor: float | None) -> None:
    fig, ax = agg_subplots(figsize=(7.5, 4.5))
    for run in runs:
        steps = sorted(run["curve"])
        ax.plot(steps, [run["curve"][s] for s in steps], marker="o", markersize=3, label=run["label"])
    if floor:
        ax.axhline(floor, color="grey", linestyle="--", label=f"context ignored (unigram): {floor:.0f}")
    ax.set_yscale("log")
    ax.set_xlabel("updates")
    ax.set_ylabel("validation MLM perplexity")
    ax.set_title("Pretraining: perplexity vs updates (paper Figure 3 at our scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories; the first is the reference")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pretrain")
    args = parser.parse_args(argv)
    load_before = load_average()
    runs = [read_run(run) for run in args.runs]
    reference = runs[0]
    steps = sorted(set.intersection(*(set(run["curve"]) for run in runs)))

    rows = [
        {"run": run["run"], "model": run["label"], "step": step, "perplexity": run["curve"][step],
         "ratio_to_reference": run["curve"][step] / reference["curve"][step]}
        for run in runs for step in sorted(run["curve"]) if step in reference["curve"]
    ]  # fmt: skip
    write_csv(args.out.with_suffix(".csv"), rows)
    table = [{"step": step, **{run["label"]: run["curve"][step] for run in runs}} for step in steps]
    ratios = [
        {"model": run["label"], **{str(step): f"{run['curve'][step] / reference['curve'][step]:.3f}" for step in steps}}
        for run in runs[1:]
    ]
    train = reference["train"]
    data = Path(reference["data"]) if reference["data"] else None
    floor = unigram_perplexity(data) if data and (data / "dev.ids.npy").exists() else None
    lines = header("Pretraining perplexity vs updates (paper Figure 3 at our scale)", ("torch",), load_before)
    lines += [
        f"Validation MLM perplexity on the same fixed masks (`{args.runs[0].parent}/*/metrics.jsonl`). Recipe "
        f"(every run): peak lr {train.get('lr')}, {train.get('warmup_steps')} warm-up steps, cosine schedule over "
        f"{train.get('schedule_steps') or train.get('max_steps')} steps, batches of {train.get('max_tokens')} tokens "
        "(512-token sequences). Runs marked short were stopped before the end of the same "
        "schedule (`--schedule-steps`), so every point compares at equal updates and equal learning rate.",
        "",
        f"A model that ignores the context (training-set token frequencies) scores {floor:.0f} on the same tokens."
        if floor else "",
        "",
        "| run | model | steps | wall (min) | trained on |",
        "|---|---|---|---|---|",
        *(f"| `{run['run']}` | {run['label']} | {max(run['curve'])}{'' if run['finished'] else ' (unfinished)'}"
          f"{' (short)' if run['train'].get('schedule_steps', 0) > run['train'].get('max_steps', 0) else ''}"
          f" | {run['minutes']:.1f} | {run['where']} |" for run in runs),  # fmt: skip
        "",
        "Perplexity at equal updates:",
        "",
        *markdown_table(table, {"step": "updates", **{run["label"]: run["label"] for run in runs}}),
        "",
        f"Ratio to {reference['label']} (1.00 = on par; the issue's bar is ≤ 1.10 for k = 128):",
        "",
        *markdown_table(ratios, {"model": "model", **{str(step): str(step) for step in steps}}),
        "",
        f"![perplexity vs updates]({args.out.name}.png)",
        "",
    ]
    write_markdown(args.out.with_suffix(".md"), lines)
    plot(runs, args.out.with_suffix(".png"), floor)


if __name__ == "__main__":
    main()
