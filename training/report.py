"""Results table in the shape of the paper's Table 2, from the summary.json each training run writes.

    python -m training.report runs/classify-linformer-k128 runs/classify-linformer-k256 runs/classify-transformer \
        --out benchmarks/results/classify.md
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
    linformer = cfg["attention"] == "linformer"
    projection = cfg.get("projection", "linear") + (", mean init" if cfg.get("projection_init") == "mean" else "")
    return {
        "run": run.name,
        "model": "Linformer" if linformer else "Transformer",
        "n": cfg["n_max"],
        "k": cfg["k"] if linformer else "-",
        "sharing": cfg["sharing"] if linformer else "-",
        "projection": projection if linformer else "-",
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
    args = parser.parse_args(argv)
    rows = [row(run) for run in args.runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = "| " + " | ".join(rows[0]) + " |"
    lines = [
        "# IMDB classification: Linformer vs Transformer (paper Table 2 shape)",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by `python -m training.report "
        + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        f"on {platform.node()} ({platform.machine()}, Python {platform.python_version()}). Test = 1,500 held-out "
        "IMDB reviews of the seeded split; the same data, recipe, epochs and token budget for every row.",
        *([args.note, ""] if args.note else [""]),
        header,
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
