"""The EN->DE results table: one row per training run, from what training and evaluation wrote (not a test).

Reads runs/<run>/summary.json (training: steps, wall time, dev/test perplexity) and
runs/<run>/eval-test-beam<N>.json (`python -m training translate-eval`: BLEU, chrF, PyTorch decode time),
and writes benchmarks/results/translate.md.

    python benchmarks/translate_results.py runs/translate-linformer-k32 runs/translate-linformer-k64 \
        runs/translate-transformer
"""

import argparse
import csv
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def describe(cfg: dict) -> str:
    if cfg["attention"] == "linformer" and cfg.get("cross_attention", "linformer") == "transformer":
        return f"Linformer k={cfg['k']}, full cross-attention"
    if cfg["attention"] == "linformer":
        return f"Linformer k={cfg['k']}, k_cross={cfg['k_cross']}"
    return "Transformer"


def bundle_lines(results: Path) -> list[str]:
    """The served bundles (models/translate-*): size, parity at export, and the cache benchmark's speedups."""
    lines = ["## Served bundles (ONNX Runtime)", "",
             "| bundle | attention | size | greedy identical to PyTorch | max logit diff | KV-cache speedup |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for bundle in sorted((REPO / "models").glob("translate-*")):
        config = json.loads((bundle / "config.json").read_text())
        size = sum(f.stat().st_size for f in bundle.iterdir()) / 1e6
        parity = config["parity"]
        diff = max(parity["max_abs_logit_diff_cached_steps"], parity["max_abs_logit_diff_full_prefix"])
        bench = results / f"decode-cache-{bundle.name}.csv"
        speedups = "–"
        if bench.exists():
            rows = list(csv.DictReader(bench.open()))
            speedups = ", ".join(f"B={r['batch']} {r['steps']} tok: {r['speedup']}x" for r in rows)
        kind = describe(config["model_config"])
        lines.append(f"| `{bundle.name}` | {kind} | {size:.1f} MB | {parity['greedy_identical']}/"
                     f"{parity['sentences']} | {diff:.1e} | {speedups} |")  # fmt: skip
    return [*lines, "", "Cache benchmark details: `decode-cache-<bundle>.md` (command, machine, versions).", ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "translate.md")
    args = parser.parse_args(argv)

    rows, notes = [], []
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        cfg, train = summary["model_config"], summary["train_config"]
        evaluations = sorted(
            (json.loads(p.read_text()) for p in run.glob("eval-test-beam*.json") if "first" not in p.name),
            key=lambda e: e["beam_size"],
        )
        for ev in evaluations:
            rows.append(
                f"| {describe(cfg)} | {summary['dev']['ppl']:.2f} | {ev['bleu']:.2f} | {ev['chrf']:.2f} | "
                f"{summary['train_wall_s'] / 60:.1f} min ({summary['steps']} steps) | beam {ev['beam_size']}: "
                f"{ev['decode_s']:.1f} s ({ev['decode_ms_per_sentence']:.1f} ms/sentence) |"
            )
        if not evaluations:
            rows.append(f"| {describe(cfg)} | {summary['dev']['ppl']:.2f} | – | – | "
                        f"{summary['train_wall_s'] / 60:.1f} min ({summary['steps']} steps) | – |")  # fmt: skip
        notes.append(f"- `{run}`: {summary['parameters']:,} parameters, test PPL {summary['test']['ppl']:.2f}")
    first = json.loads((args.runs[0] / "summary.json").read_text())
    cfg, train = first["model_config"], first["train_config"]
    ev_any = next(
        (json.loads(p.read_text()) for run in args.runs for p in run.glob("eval-test-beam*.json")), None
    )
    lines = [
        "# EN->DE translation: Linformer vs Transformer",
        "",
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; machine: {cpu_model()}, "
        f"nproc {os.cpu_count()}, {platform.platform()}; the three runs trained in parallel, "
        f"{train['threads']} torch thread each.",
        f"- Command: `python {' '.join([Path(sys.argv[0]).as_posix(), *map(str, args.runs)])}`",
        f"- Same recipe and budget for all: d_model {cfg['d_model']}, {cfg['n_layers']}+{cfg['n_decoder_layers']} "
        f"layers, {cfg['n_heads']} heads, d_ff {cfg['d_ff']}, dropout {cfg['dropout']}, n_max {cfg['n_max']}, "
        f"tgt_n_max {cfg['tgt_n_max']}; label smoothing 0.1; AdamW lr {train['lr']}, {train['warmup_steps']} "
        f"warm-up steps, cosine decay; batches of <= {train['max_tokens']} padded tokens; "
        + (f"{train['max_steps']} steps" if train.get("max_steps") else f"{train['epochs']} epochs")
        + f"; seed {train['seed']}. Linformer: layerwise-shared linear E in the encoder"
        + (" (initialised as mean pooling over n_max/k positions)" if cfg.get("projection_init") == "mean" else "")
        + ", cross-attention compressed to k_cross rows or full, as each row says; Transformer: full attention "
        "in both.",
        "- PPL: exp of the per-token NLL (no smoothing) of the dev references, EOS included; best-dev-PPL "
        "checkpoint. BLEU/chrF: sacrebleu on the 1,500 test pairs, detokenised with SentencePiece"
        + (f" (`{ev_any['bleu_signature']}`, `{ev_any['chrf_signature']}`)" if ev_any else "") + ".",
        "- Inference time: PyTorch decoding of the 1,500 test sources with the key/value cache, batches of "
        f"{ev_any['batch_size'] if ev_any else '?'} sentences sorted by length, "
        f"{ev_any['threads'] if ev_any else '?'} thread(s).",
        "",
        "| model | PPL (dev) | BLEU (test) | chrF (test) | train time | inference time (test) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        *notes,
        "",
    ]
    lines += bundle_lines(args.out.parent)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
