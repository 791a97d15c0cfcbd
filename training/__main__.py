"""Training CLI.

    python -m training classify --attention linformer --k 128 --n-max 4096 --out runs/classify-linformer-k128
    python -m training classify --attention transformer --n-max 4096 --out runs/classify-transformer
    python -m training classify --attention performer --n-max 4096 --out runs/classify-performer
    python -m training pretrain --attention linformer --k 128 --projection mean --out runs/pretrain-linformer-k128
    python -m training classify --data .cache/data/reviews --init-from runs/pretrain-linformer-k128/best.pt ...
    python -m training translate --attention linformer --k 64 --out runs/translate-linformer-k64
    python -m training translate-eval --checkpoint runs/translate-linformer-k64/best.pt --split test
    torchrun --nproc_per_node=2 -m training classify ...      # DistributedDataParallel (gloo on CPU)

Data comes from `python -m training.imdb` (.cache/data/imdb), `python -m training.ende` (.cache/data/ende) and
`python -m training.corpus` (.cache/data/corpus for pretraining, .cache/data/reviews for fine-tuning).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from model import ModelConfig
from training.trainer import TrainConfig, train


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", choices=["linformer", "transformer", "performer"], default="linformer")
    p.add_argument("--k", type=int, nargs="+", default=[128], help="projected length; one per layer allowed")
    p.add_argument("--n-max", type=int, default=4096)
    p.add_argument("--sharing", choices=["none", "headwise", "key-value", "layerwise"], default="layerwise")
    p.add_argument("--projection", choices=["linear", "mean", "max", "conv"], default="linear")
    p.add_argument("--projection-init", choices=["random", "mean"], default="random",
                   help="linear E/F: random (fairseq) or starting as mean pooling over n_max/k positions")
    p.add_argument("--n-features", type=int, default=0,
                   help="performer: random features M per head (default d_head ln d_head, whole blocks of d_head)")
    p.add_argument("--feature-redraw", type=int, default=0,
                   help="performer: draw new random features every N training steps (0: never; never at inference)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.1)


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, summary.json")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--schedule-steps", type=int, default=0,
                   help="learning-rate schedule length (default: the run's); a shorter --max-steps stops early on it")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=8192, help="padded tokens per batch and process")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate on dev every N steps (0: per epoch)")
    p.add_argument("--keep-checkpoints", type=int, default=0,
                   help="also keep the weights of the last N --save-every steps (for checkpoint averaging)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default="cpu", help="where the model trains and evaluates, e.g. cuda on a GPU machine "
                   "(batches are built on the CPU)")


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        out_dir=args.out, epochs=args.epochs, max_steps=args.max_steps, schedule_steps=args.schedule_steps, lr=args.lr,
        weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_tokens=args.max_tokens,
        max_batch=args.max_batch, seed=args.seed, threads=args.threads, save_every=args.save_every,
        eval_every=args.eval_every, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        device=args.device,
    )  # fmt: skip


def model_config(args: argparse.Namespace, data_meta: dict, **task_fields) -> ModelConfig:
    """The encoder every task shares, from the model arguments; the task adds its own fields."""
    return ModelConfig(
        vocab_size=data_meta["tokenizer"]["vocab_size"], n_max=args.n_max, d_model=args.d_model,
        n_heads=args.n_heads, n_layers=args.n_layers, d_ff=args.d_ff, dropout=args.dropout,
        attention=args.attention, k=args.k[0] if len(args.k) == 1 else args.k, sharing=args.sharing,
        projection=args.projection, projection_init=args.projection_init,
        n_features=args.n_features, feature_redraw=args.feature_redraw, **task_fields,
    )  # fmt: skip


def run_classify(args: argparse.Namespace) -> None:
    from training.classify import LABELS, ClassifyTask

    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    task = ClassifyTask(data, model_config(args, meta, num_labels=len(LABELS)))
    extra = {"task": "classify", "labels": LABELS, "data": str(data), "data_meta": meta}
    if args.init_from:
        from training.trainer import load_pretrained_encoder

        pretrained = load_pretrained_encoder(task.model, Path(args.init_from))
        extra["init_from"] = {"checkpoint": args.init_from, "model_config": pretrained}
    train(task, train_config(args), extra=extra)


def run_pretrain(args: argparse.Namespace) -> None:
    from training.pretrain import PretrainTask

    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    task = PretrainTask(data, model_config(args, meta), seq_len=args.seq_len, mask_prob=args.mask_prob, seed=args.seed,
                        eval_sequences=args.eval_sequences)  # fmt: skip
    extra = {"task": "pretrain", "data": str(data), "data_meta": {k: meta[k] for k in ("sha256", "tokens", "sources")},
             "seq_len": args.seq_len, "mask_prob": args.mask_prob, "train_sequences": task.train_rows.shape[0]}
    train(task, train_config(args), extra=extra)


def run_translate(args: argparse.Namespace) -> None:
    from training.translate import TranslateTask

    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    # Linformer models compress the encoder self-attention to k and, unless --cross-attention transformer,
    # the cross-attention to k_cross (default k). Performer models attend over the source in full.
    cross = args.cross_attention or ("transformer" if args.attention == "performer" else args.attention)
    cfg = model_config(
        args, meta, n_decoder_layers=args.n_decoder_layers, tgt_n_max=args.tgt_n_max,
        cross_attention=cross, k_cross=(args.k_cross or args.k[0]) if cross == "linformer" else 0,
    )  # fmt: skip
    task = TranslateTask(data, cfg)
    extra = {"task": "translate", "data": str(data), "data_meta": meta}
    if args.init_from:  # go on training a model (all its weights) on this data, with a new schedule
        start = torch.load(args.init_from, map_location="cpu", weights_only=False)
        differ = [key for key, value in asdict(cfg).items() if key != "dropout" and start["model_config"][key] != value]
        if differ:
            raise ValueError(f"{args.init_from} differs from this model in {', '.join(differ)}")
        task.model.load_state_dict(start["model"])
        extra["init_from"] = {"checkpoint": args.init_from, **start.get("extra", {})}
    print(f"training pairs: {len(task.splits['train']['src'])} (dropped as longer than n_max/tgt_n_max: "
          f"{task.dropped_from_train})")  # fmt: skip
    train(task, train_config(args), extra={**extra, "dropped_from_train": task.dropped_from_train})


def run_translate_eval(args: argparse.Namespace) -> None:
    from training.translate_eval import evaluate_checkpoint

    result = evaluate_checkpoint(
        Path(args.checkpoint), args.split, beam_size=args.beam_size, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, threads=args.threads, data=args.data, limit=args.limit,
    )  # fmt: skip
    print(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    classify = sub.add_parser("classify", help="train a sequence classifier on prepared IMDB data")
    classify.add_argument("--data", default=".cache/data/imdb",
                          help="prepared data; .cache/data/reviews (python -m training.corpus) adds Rotten Tomatoes")
    classify.add_argument("--init-from", help="a pretrain checkpoint whose encoder weights the classifier starts from")
    add_model_args(classify)
    add_train_args(classify)
    classify.set_defaults(run=run_classify)

    pretrain = sub.add_parser("pretrain", help="masked-language-model pretraining on the English corpus")
    pretrain.add_argument("--data", default=".cache/data/corpus")
    pretrain.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence, BOS included")
    pretrain.add_argument("--mask-prob", type=float, default=0.15)
    pretrain.add_argument("--eval-sequences", type=int, default=256, help="validation sequences (fixed masks)")
    add_model_args(pretrain)
    add_train_args(pretrain)
    pretrain.set_defaults(run=run_pretrain, n_max=512, epochs=1)

    translate = sub.add_parser("translate", help="train an EN->DE encoder-decoder on prepared data")
    translate.add_argument("--data", default=".cache/data/ende")
    add_model_args(translate)
    translate.add_argument("--n-decoder-layers", type=int, default=3)
    translate.add_argument("--tgt-n-max", type=int, default=256)
    translate.add_argument("--k-cross", type=int, default=0, help="compressed cross-attention length (default k)")
    translate.add_argument("--cross-attention", choices=["linformer", "transformer"],
                           help="decoder attention over the source (default: as --attention)")
    translate.add_argument("--init-from", help="a translate checkpoint of the same architecture to start from (e.g. "
                           "one rebuilt from a served bundle by python -m training.recover_translate)")
    add_train_args(translate)
    translate.set_defaults(run=run_translate, n_max=256, n_layers=3, k=[64])

    evaluate = sub.add_parser("translate-eval", help="BLEU/chrF on a split, dev perplexity, decode time")
    evaluate.add_argument("--checkpoint", required=True)
    evaluate.add_argument("--split", default="test", choices=["dev", "test"])
    evaluate.add_argument("--beam-size", type=int, default=1)
    evaluate.add_argument("--batch-size", type=int, default=64)
    evaluate.add_argument("--max-new-tokens", type=int, default=256)
    evaluate.add_argument("--threads", type=int, default=0)
    evaluate.add_argument("--limit", type=int, default=0, help="only the first N sentences (0: all)")
    evaluate.add_argument("--data", help="default: the data directory the run trained on")
    evaluate.set_defaults(run=run_translate_eval)
    args = parser.parse_args(argv)
    if "seed" in args:  # the model is initialised when its task is built, before train() runs
        torch.manual_seed(args.seed)
    args.run(args)


if __name__ == "__main__":
    main()
