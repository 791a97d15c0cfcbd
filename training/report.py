"""Results table in the shape of the paper's Table 2, from the summary.json each training run writes.

    python -m training.report runs/classify-linformer-k128 runs/classify-linformer-k256 runs/classify-transformer \
        --out benchmarks/results/classify.md
    python -m training.report runs/classify-performer --append --out benchmarks/results/classify.md --note "..."

--append keeps the rows already in the CSV (runs trained in earlier sessions, whose run directories are gone)
and adds the new ones, saying which rows came when and by which command.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path


def row(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    cfg = s["model_config"]
    linformer, performer = cfg["attention"] == "linformer", cfg["attention"] == "performer"
    projection = cfg.get("projection", "linear") + (", mean init" if cfg.get("projection_init") == "mean" else "")
    if performer:  # FAVOR+ has no projection E; its random features stand in that column
        from model import ModelConfig

        projection = f"FAVOR+, M = {ModelConfig(**cfg).features()} random features"
    return {
        "run": run.name,
        "model": "Linformer" if linformer else "Performer" if performer else "Transformer",
        "n": cfg["n_max"],
        "k": cfg["k"] if linformer else "-",
        "sharing": cfg["sharing"] if linformer else "-",
        "projection": projection if linformer or performer else "-",
        "test_accuracy": round(100 * s["test"]["accuracy"], 2),
        "dev_accuracy": round(100 * s["dev"]["accuracy"], 2),
        "parameters": s["parameters"],
        "epochs": s["epochs_completed"],
        "steps": s["steps"],
        "train_wall_min": round(s["train_wall_s"] / 60, 1),
        "processes_x_threads": f"{s['processes']}x{s['threads_per_process']}",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="Markdown file; a CSV is written beside it")
    parser.add_argument("--note", default="", help="a sentence on how the runs shared the machine")
    parser.add_argument("--append", action="store_true", help="keep the rows and text already in --out")
    args = parser.parse_args(argv)
    rows = [row(run) for run in args.runs]
    command = "python -m training.report " + " ".join(sys.argv[1:] if argv is None else argv)
    now = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"
    if args.append:
        with open(args.out.with_suffix(".csv"), newline="") as f:
            kept = [r for r in csv.DictReader(f) if r["run"] not in {new["run"] for new in rows}]
        text = args.out.read_text()
        intro = text[: text.index("\n| run |")].rstrip("\n").split("\n")
        intro += ["", f"Rows {', '.join(r['run'] for r in rows)} added {now} by `{command}`."]
        intro += [args.note] if args.note else []
        rows = kept + rows
        write_table(args.out, rows, intro)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    intro = [
        "# IMDB classification: Linformer vs Transformer (paper Table 2 shape)",
        "",
        f"Generated {now} by `{command}`",
        f"on {platform.node()} ({platform.machine()}, Python {platform.python_version()}). Test = 1,500 held-out "
        "IMDB reviews of the seeded split; the same data, recipe, epochs and token budget for every row.",
        *([args.note] if args.note else []),
    ]
    write_table(args.out, rows, intro)


def write_table(out: Path, rows: list[dict], intro: list[str]) -> None:
    """The CSV, and the Markdown: the intro lines, then the table."""
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        *intro,
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows),
        "",
    ]
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
