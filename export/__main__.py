"""Export a training checkpoint to a served bundle.

    python -m export classify --checkpoint runs/classify-linformer-k128/best.pt --out models/classify-linformer
    python -m export translate --checkpoint runs/translate-linformer-k64/best.pt --out models/translate-linformer
    python -m export quantize --bundle models/translate-linformer --out models/translate-linformer-int8
    python -m export calibrate --bundle models/classify-linformer  (the batcher's token budget, measured)
    python -m export ctranslate2 --bundle models/translate-transformer --out .cache/ct2/translate-transformer
    python -m export step-decoder --bundle models/translate-linformer --parity-tsv .cache/data/ende/test.tsv
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
    classify.add_argument("--note", default="", help="a line for the model card, e.g. how training shared the machine")
    translate = sub.add_parser("translate")
    translate.add_argument("--checkpoint", type=Path, required=True)
    translate.add_argument("--out", type=Path, required=True, help="bundle directory, e.g. models/translate-linformer")
    translate.add_argument("--name", help="bundle name (default: the --out directory name)")
    translate.add_argument("--tokenizer", type=Path, help="default: spm.model of the data the run trained on")
    translate.add_argument("--parity-sentences", type=int, default=200, help="first N test sentences")
    translate.add_argument("--note", action="append", default=[], help="a line for the model card's recipe")
    quantize = sub.add_parser("quantize", help="int8 twin of an exported bundle (ONNX Runtime dynamic quantisation)")
    quantize.add_argument("--bundle", type=Path, required=True, help="fp32 bundle, e.g. models/classify-linformer")
    quantize.add_argument("--out", type=Path, required=True, help="e.g. models/classify-linformer-int8")
    quantize.add_argument("--per-channel", action="store_true", help="one weight scale per output column")
    calibrate = sub.add_parser("calibrate", help="measure texts/s against batch size x length on this machine and "
                                                 "write the batcher's token budget into the bundle's manifest.json")
    calibrate.add_argument("--bundle", type=Path, required=True, help="classify bundle, e.g. models/classify-linformer")
    calibrate.add_argument("--threads", type=int, default=1, help="ORT threads per server process (default 1)")
    calibrate.add_argument("--reuse-table", action="store_true",
                           help="choose again from the table already in manifest.json instead of measuring")
    peer = sub.add_parser("ctranslate2", help="the same weights as a CTranslate2 model (the benchmark peer)")
    peer.add_argument("--bundle", type=Path, required=True, help="a vanilla translator: models/translate-transformer")
    peer.add_argument("--out", type=Path, required=True, help="e.g. .cache/ct2/translate-transformer (not a bundle)")
    peer.add_argument("--quantization", help="store weights as e.g. int8 (default fp32; int8 can be chosen at load)")
    step = sub.add_parser("step-decoder", help="rewrite a translation bundle's decoder.onnx in the step form "
                          "(in place; export/step_decoder.py), checked against the decoder it replaces")
    step.add_argument("--bundle", type=Path, required=True, help="fp32 translation bundle (models/translate-*)")
    step.add_argument("--parity-tsv", type=Path, help="test.tsv (source, en, de) for the greedy parity check "
                                                      "(default: 64 random sources)")
    step.add_argument("--parity-sentences", type=int, default=1500, help="first N sentences of --parity-tsv")
    args = parser.parse_args(argv)

    if args.task == "step-decoder":  # a bundle in, the same bundle out: no checkpoint, no torch
        from export.step_decoder import convert_bundle, parity_sources_from_tsv

        sources = None
        if args.parity_tsv:
            sources = parity_sources_from_tsv(args.bundle, args.parity_tsv, args.parity_sentences)
        config = convert_bundle(args.bundle, sources)
        print(json.dumps({"bundle": str(args.bundle), "step_parity": config["export"]["step_parity"]}))
        return
    if args.task == "calibrate":  # onnxruntime only: runs on the serving machine without torch
        from export.calibrate import calibrate_bundle, table_markdown

        batching = calibrate_bundle(args.bundle, args.threads, reuse_table=args.reuse_table)
        print(table_markdown(batching))
        print(json.dumps({"bundle": str(args.bundle), "max_batch_tokens": batching["max_batch_tokens"],
                          "worst_length_ratio_to_best": batching["worst_length_ratio_to_best"],
                          "max_batch_size_by_length": batching["max_batch_size_by_length"]}))  # fmt: skip
        return
    if args.task == "ctranslate2":  # a bundle in, a CTranslate2 model out: no checkpoint, no torch
        from export.ctranslate2 import convert

        print(json.dumps({"ctranslate2_model": str(convert(args.bundle, args.out, args.quantization))}))
        return
    if args.task == "quantize":  # a bundle in, a bundle out: no checkpoint, no torch
        from export.quantize import quantize_bundle

        config = quantize_bundle(args.bundle, args.out, per_channel=args.per_channel)
        print(json.dumps({"bundle": str(args.out), "quantization": config["export"]["quantization"]}))
        return

    import torch

    extra = torch.load(args.checkpoint, map_location="cpu", weights_only=False).get("extra", {})
    tokenizer = args.tokenizer or Path(extra["data"]) / "spm.model"
    name = args.name or args.out.name
    if args.task == "classify":
        from export.calibrate import calibrate_bundle
        from export.classify import export_classifier

        config = export_classifier(args.checkpoint, tokenizer, args.out, name, note=args.note)
        config["batching"] = {"max_batch_tokens": calibrate_bundle(args.out)["max_batch_tokens"]}
    else:
        import sentencepiece as spm

        from export.translate import export_translator
        from training.translate import encode_source, read_pairs

        sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
        n_max = torch.load(args.checkpoint, map_location="cpu", weights_only=False)["model_config"]["n_max"]
        pairs = read_pairs(Path(extra["data"]) / "test.tsv")[: args.parity_sentences]
        sources = [encode_source(sp, en, n_max) for en, _ in pairs]
        config = export_translator(args.checkpoint, tokenizer, args.out, name, sources, notes=args.note)
    print(json.dumps({"bundle": str(args.out), "parity": config["parity"], "export": config["export"],
                      "batching": config.get("batching")}))  # fmt: skip


if __name__ == "__main__":
    main()
