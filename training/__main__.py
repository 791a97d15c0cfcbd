"""Training CLI.

    python -m training classify --attention linformer --k 128 --n-max 4096 --out runs/classify-linformer-k128
    python -m training classify --attention transformer --n-max 4096 --out runs/classify-transformer
    torchrun --nproc_per_node=2 -m training classify ...      # DistributedDataParallel (gloo on CPU)

Data comes from `python -m training.imdb` (cached under .cache/data/imdb).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from model import ModelConfig
from training.trainer import TrainConfig, train


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", choices=["linformer", "transformer"], default="linformer")
    p.add_argument("--k", type=int, nargs="+", default=[128], help="projected length; one per layer allowed")
    p.add_argument("--n-max", type=int, default=4096)
    p.add_argument("--sharing", choices=["none", "headwise", "key-value", "layerwise"], default="layerwise")
    p.add_argument("--projection", choices=["linear", "mean", "max", "conv"], default="linear")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.1)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, summary.json")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8192, help="padded tokens per batch and process")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--resume", action="store_true")


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        out_dir=args.out, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_tokens=args.max_tokens,
        max_batch=args.max_batch, seed=args.seed, threads=args.threads, save_every=args.save_every,
        resume=args.resume,
    )  # fmt: skip


def run_classify(args: argparse.Namespace) -> None:
    from training.classify import LABELS, ClassifyTask

    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    cfg = ModelConfig(
        vocab_size=meta["tokenizer"]["vocab_size"], n_max=args.n_max, d_model=args.d_model,
        n_heads=args.n_heads, n_layers=args.n_layers, d_ff=args.d_ff, dropout=args.dropout,
        attention=args.attention, k=args.k[0] if len(args.k) == 1 else args.k, sharing=args.sharing,
        projection=args.projection, num_labels=len(LABELS),
    )  # fmt: skip
    task = ClassifyTask(data, cfg)
    train(
        task,
        train_config(args),
        extra={"task": "classify", "labels": LABELS, "data": str(data), "data_meta": meta},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    classify = sub.add_parser("classify", help="train a sequence classifier on prepared IMDB data")
    classify.add_argument("--data", default=".cache/data/imdb")
    add_model_args(classify)
    add_train_args(classify)
    classify.set_defaults(run=run_classify)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
