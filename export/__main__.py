"""Export a training checkpoint to a served bundle.

    python -m export classify --checkpoint runs/classify-linformer-k128/best.pt --out models/classify-linformer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="task", required=True)
    classify = sub.add_parser("classify")
    classify.add_argument("--checkpoint", type=Path, required=True)
    classify.add_argument("--out", type=Path, required=True, help="bundle directory, e.g. models/classify-linformer")
    classify.add_argument("--name", help="bundle name (default: the --out directory name)")
    classify.add_argument("--tokenizer", type=Path, help="default: spm.model of the data the run trained on")
    args = parser.parse_args(argv)

    import torch

    from export.classify import export_classifier

    extra = torch.load(args.checkpoint, map_location="cpu", weights_only=False).get("extra", {})
    tokenizer = args.tokenizer or Path(extra["data"]) / "spm.model"
    config = export_classifier(args.checkpoint, tokenizer, args.out, args.name or args.out.name)
    print(json.dumps({"bundle": str(args.out), "parity": config["parity"], "export": config["export"]}))


if __name__ == "__main__":
    main()
