"""Average the weights of a run's last kept checkpoints (`--keep-checkpoints N` keeps step-<N>.pt files).

    python -m training.average runs/ende2-linformer-k64 --last 5

Writes RUN/averaged.pt in the format of best.pt (model, model_config, extra), so translate-eval, the
per-domain benchmark and the exporter read it like any checkpoint. Averaging the last few checkpoints of a
decaying learning rate usually lowers perplexity a little at no training cost; whether it did here is
measured, not assumed (the evaluation compares it with best.pt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def kept_checkpoints(run: Path, last: int) -> list[Path]:
    return sorted(run.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))[-last:]


def average_checkpoints(paths: list[Path]) -> dict:
    """The mean of the checkpoints' weights, with the newest one's config and extra."""
    if not paths:
        raise ValueError("no checkpoints to average")
    loaded = [torch.load(path, map_location="cpu", weights_only=False) for path in paths]
    names = loaded[-1]["model"].keys()
    if any(saved["model"].keys() != names for saved in loaded):
        raise ValueError("the checkpoints hold different parameters")
    averaged = {name: sum(saved["model"][name].double() for saved in loaded) / len(loaded) for name in names}
    model = {name: averaged[name].to(loaded[-1]["model"][name].dtype) for name in names}
    steps = [saved.get("step") for saved in loaded]
    extra = {**loaded[-1].get("extra", {}), "averaged_steps": steps}
    return {"model": model, "model_config": loaded[-1]["model_config"], "extra": extra}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--out", type=Path, help="default: RUN/averaged.pt")
    args = parser.parse_args(argv)
    paths = kept_checkpoints(args.run, args.last)
    out = args.out or args.run / "averaged.pt"
    averaged = average_checkpoints(paths)
    if (args.run / "last.pt").exists():  # the recipe, for the model card
        last = torch.load(args.run / "last.pt", map_location="cpu", weights_only=False)
        averaged["train_config"] = last["train_config"]
    torch.save(averaged, out)
    print(json.dumps({"averaged": [str(p) for p in paths], "out": str(out)}))


if __name__ == "__main__":
    main()
