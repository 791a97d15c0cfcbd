"""The EN->DE results table: one row per training run, from what training and evaluation wrote (not a test).

Reads runs/<run>/summary.json (training: steps, wall time, dev/test perplexity) and
runs/<run>/eval-test-beam<N>.json (`python -m training translate-eval`: BLEU, chrF, PyTorch decode time),
and writes benchmarks/results/translate.{csv,md}. Rows of runs not named on the command line are kept
from the CSV, so a run trained later adds its rows to the committed ones.

    python benchmarks/translate_results.py runs/translate-linformer-k32 runs/translate-transformer \
        --trained "alone, 2 threads"
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
sys.path.insert(0, str(REPO))

from loadtest.report import write_markdown  # noqa: E402


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


COLUMNS = ["run", "kind", "model", "ppl_dev", "ppl_test", "parameters", "beam", "bleu", "chrf", "test_pairs",
           "train_min", "train_s", "steps", "trained", "decode_s", "decode_ms_per_sentence", "eval_threads", "measured",
           "recipe", "signatures"]  # fmt: skip


def mtime(path: Path) -> str:
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def recipe(cfg: dict, train: dict) -> str:
    return (
        f"d_model {cfg['d_model']}, {cfg['n_layers']}+{cfg['n_decoder_layers']} layers, {cfg['n_heads']} heads, "
        f"d_ff {cfg['d_ff']}, dropout {cfg['dropout']}, n_max {cfg['n_max']}, tgt_n_max {cfg['tgt_n_max']}; label "
        f"smoothing 0.1; AdamW lr {train['lr']}, {train['warmup_steps']} warm-up steps, cosine decay; batches of "
        f"<= {train['max_tokens']} padded tokens; "
        + (f"{train['max_steps']} steps" if train.get("max_steps") else f"{train['epochs']} epochs")
        + f"; seed {train['seed']}. Linformer: layerwise-shared linear E in the encoder"
        + (" (initialised as mean pooling over n_max/k positions)" if cfg.get("projection_init") == "mean" else "")
        + ", cross-attention compressed to k_cross rows or full, as each row says; Transformer: full attention in "
        "both."
    )


def run_rows(run: Path, trained: str | None) -> list[dict]:
    """One row per test evaluation (beam size) of a run, or one without BLEU if it was not evaluated."""
    summary = json.loads((run / "summary.json").read_text())
    threads = summary.get("threads_per_process", summary["train_config"]["threads"])
    common = {
        "run": run.name, "model": describe(summary["model_config"]), "ppl_dev": round(summary["dev"]["ppl"], 2),
        "ppl_test": round(summary["test"]["ppl"], 2), "parameters": summary["parameters"],
        "train_min": round(summary["train_wall_s"] / 60, 1), "train_s": summary["train_wall_s"],
        "steps": summary["steps"],
        "trained": trained or f"{threads} torch thread(s)",
        "recipe": recipe(summary["model_config"], summary["train_config"]),
        "measured": mtime(run / "summary.json"),
    }  # fmt: skip
    evaluations = sorted(
        ((json.loads(p.read_text()), p) for p in run.glob("eval-test-beam*.json") if "first" not in p.name),
        key=lambda pair: pair[0]["beam_size"],
    )
    if not evaluations:
        return [common]
    return [
        {**common, "beam": ev["beam_size"], "bleu": round(ev["bleu"], 2), "chrf": round(ev["chrf"], 2),
         "test_pairs": ev.get("sentences", ""),
         "decode_s": round(ev["decode_s"], 1), "decode_ms_per_sentence": round(ev["decode_ms_per_sentence"], 1),
         "eval_threads": ev["threads"], "measured": mtime(path),
         "signatures": f"`{ev['bleu_signature']}`, `{ev['chrf_signature']}`"}  # fmt: skip
        for ev, path in evaluations
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="*")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "translate.md")
    parser.add_argument("--trained", help='how the given runs shared the machine, e.g. "alone, 2 threads"')
    parser.add_argument("--timing", action="store_true",
                        help="the given runs are short runs that time training only (their own table)")
    args = parser.parse_args(argv)

    # Rows of runs not given here are kept from the earlier CSV: runs/ is not in git, the results are.
    table = args.out.with_suffix(".csv")
    given = {run.name for run in args.runs}
    earlier = list(csv.DictReader(table.open())) if table.exists() else []
    rows = [r for r in earlier if r["run"] not in given]
    for run in args.runs:
        rows += [{**row, "kind": "timing" if args.timing else "result"} for row in run_rows(run, args.trained)]
    # the full-attention-over-the-source Linformers next to the Transformer, the compressed ones after
    rows.sort(key=lambda r: ("k_cross" in r["model"], r["model"] == "Transformer", r["model"], int(r.get("beam") or 0)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)

    def cell(row: dict, key: str) -> str:  # values are rounded when a row is made; CSV rows are strings
        return str(row[key]) if row.get(key) not in (None, "") else "–"

    lines = [
        "# EN->DE translation: Linformer vs Transformer",
        "",
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; machine: {cpu_model()}, "
        f"nproc {os.cpu_count()}, {platform.platform()}.",
        f"- Command: `python {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}` "
        f"(rows of runs not named there are kept from `{table.name}`, with the date each was measured).",
    ]
    timing = [r for r in rows if r.get("kind") == "timing"]
    rows = [r for r in rows if r.get("kind") != "timing"]
    recipes = sorted({r["recipe"] for r in rows if r.get("recipe")})
    if len(recipes) == 1:
        lines.append(f"- Same recipe and budget for all: {recipes[0]}")
    else:
        lines += [f"- Recipe: {recipe}" for recipe in recipes]
    lines += [
        "- PPL: exp of the per-token NLL (no smoothing) of the dev references, EOS included; best-dev-PPL "
        "checkpoint. BLEU/chrF: sacrebleu on the test pairs, detokenised with SentencePiece; `test pairs` says "
        "which test split: 1,500 (help + Ding, the first data version; rows without a count) or 2,250 (the "
        "second adds 750 package descriptions; per-domain scores in `translate-domains.md`)"
        + "".join(sorted({f" ({r['signatures']})" for r in rows if r.get("signatures")})) + ".",
        "- Train time: wall clock of the whole run; `trained` says whether the run had the 2 cores to itself or "
        "shared them with other runs: compare train times only between rows trained alike.",
        "- Inference time: PyTorch decoding of the 1,500 test sources with the key/value cache, batches of "
        "64 sentences sorted by length (`translate-eval --batch-size 64`), thread count per row. `measured` is when "
        "the evaluation ran: the machine's speed varied between sessions (the same ONNX model ran about 2x slower "
        "after 07:00 UTC than before), so compare inference times only between rows measured together.",
        "",
        "| model | PPL (dev) | BLEU (test) | chrF (test) | train time | trained | inference time (test) | measured "
        "| test pairs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        inference = "–"
        if r.get("beam"):
            inference = (f"beam {r['beam']}: {r['decode_s']} s ({r['decode_ms_per_sentence']} ms/sentence, "
                         f"{r['eval_threads']} thread)")  # fmt: skip
        lines.append(
            f"| {r['model']} | {cell(r, 'ppl_dev')} | {cell(r, 'bleu')} | {cell(r, 'chrf')} | {r['train_min']} min "
            f"({r['steps']} steps) | {r['trained']} | {inference} | {r['measured']} | {cell(r, 'test_pairs')} |"
        )
    if timing:
        lines += ["", "Training speed on equal terms: short runs of the same recipe (but for the step count), each "
                  "alone on the machine, over the same first batches (same seed and data), timing training only:",
                  "",
                  "| model | steps | wall time | s/step | trained | measured |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['steps']} | {float(r['train_s']):.0f} s | "
                  f"{float(r['train_s']) / int(r['steps']):.3f} | {r['trained']} | {r['measured']} |"
                  for r in timing]  # fmt: skip
    lines += ["", *sorted({f"- `runs/{r['run']}`: {int(r['parameters']):,} parameters, test PPL "
                           f"{cell(r, 'ppl_test')}" for r in rows}), ""]  # fmt: skip
    lines += bundle_lines(args.out.parent)
    write_markdown(args.out, lines)


if __name__ == "__main__":
    main()
