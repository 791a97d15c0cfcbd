"""Per-domain EN->DE scores of translation checkpoints: BLEU, chrF and the hypothesis/reference length ratio on
each held-out source and per source-length bucket, with beam search in PyTorch (not a test).

Sets, all from the prepared test split (`python -m training.ende`), none of whose English or German text is in
training:
- `help`: LibreOffice help paragraphs; `ding`: Ding everyday sentences; `desc`: Debian package descriptions of
  source packages held out of training;
- `help+ding`: the two together, which is the whole test split of the first data version (the one earlier
  results and model cards report), scored from the same translations;
- `help-long`, `desc-long`: consecutive test pairs of one source joined (sources and references alike) until the
  source has 128 tokens or more (at most n_max - 1): the test split has almost no source that long, and that is
  where a decoder that does not stop shows (the issue's repetition check).
Buckets are by source length in SentencePiece tokens (EOS excluded) over all sets. The length ratio is
sacrebleu's sys_len / ref_len (13a tokens) of the bucket or set; `repeat4` is the share of hypotheses in which
some word 4-gram occurs twice (the references' share is given beside it).

    python benchmarks/translate_domains.py --model "Linformer k=64 (served)=runs/recovered-linformer/best.pt" \
        --model "Transformer (served)=runs/recovered-transformer/best.pt" --beam 4 --threads 1 \
        --name translate-domains-served

Decoding options (PyTorch only; the service decodes without them): `--no-repeat-ngram N`, and
`--length-limit RATIO,EXTRA` to stop each sentence at RATIO x source tokens + EXTRA.
Writes benchmarks/results/<name>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import sacrebleu
import sentencepiece as spm
import torch
import torch.nn.functional as F

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
from model import Translator  # noqa: E402
from training.batching import pad  # noqa: E402
from training.decode import length_limits, translate_ids  # noqa: E402
from training.provenance import sha256_of  # noqa: E402
from training.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from training.trainer import load_trained  # noqa: E402

SOURCES = ("help", "ding", "desc")
LONG_SOURCES = ("help", "desc")
LONG_MIN_TOKENS = 128
BUCKETS = ((1, 15), (16, 31), (32, 63), (64, 127), (128, 255))


def read_test(path: Path) -> dict[str, list[tuple[str, str]]]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return {source: [(r["en"], r["de"]) for r in rows if r["source"] == source] for source in SOURCES}


def joined_pairs(pairs: list[tuple[str, str]], count_tokens: Callable[[str], int], n_max: int) -> list[tuple[str, str]]:
    """Consecutive pairs joined until the source has >= LONG_MIN_TOKENS tokens; a join that would pass n_max - 1
    starts over from the pair that overflowed, and the remainder at the end is dropped."""
    joined, en_parts, de_parts, tokens = [], [], [], 0
    for en, de in pairs:
        length = count_tokens(en)
        if tokens + length > n_max - 1:
            en_parts, de_parts, tokens = [], [], 0
        en_parts.append(en)
        de_parts.append(de)
        tokens += length
        if tokens >= LONG_MIN_TOKENS:
            joined.append((" ".join(en_parts), " ".join(de_parts)))
            en_parts, de_parts, tokens = [], [], 0
    return joined


def translate(
    model: Translator, sp: spm.SentencePieceProcessor, sources: list[str], args: argparse.Namespace
) -> list[str]:
    encoded = [sp.encode(text)[: model.cfg.n_max - 1] + [EOS_ID] for text in sources]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    hypotheses = [""] * len(encoded)
    for start in range(0, len(order), args.batch_size):
        indices = order[start : start + args.batch_size]
        src_ids, src_mask = pad([encoded[i] for i in indices], PAD_ID)
        limits = length_limits(src_mask, *args.length_limit) if args.length_limit else None
        outputs = translate_ids(model, src_ids, src_mask, args.beam, args.max_new_tokens,
                                no_repeat_ngram=args.no_repeat_ngram, max_lengths=limits)  # fmt: skip
        for i, ids in zip(indices, outputs, strict=True):
            hypotheses[i] = sp.decode(ids)
    return hypotheses


@torch.no_grad()
def dev_perplexity(model: Translator, sp: spm.SentencePieceProcessor, dev: Path, batch_size: int = 64) -> float:
    """exp(mean NLL per reference token, EOS included) on the dev split, as training's evaluate() computes it."""
    model.eval()
    with open(dev, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    pairs = [(sp.encode(r["en"])[: model.cfg.n_max - 1] + [EOS_ID], sp.encode(r["de"])[: model.cfg.tgt_n_max - 1])
             for r in rows]  # fmt: skip
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        src_ids, src_mask = pad([src for src, _ in chunk], PAD_ID)
        tgt_in, _ = pad([[BOS_ID] + tgt for _, tgt in chunk], PAD_ID)
        tgt_out, _ = pad([tgt + [EOS_ID] for _, tgt in chunk], PAD_ID)
        logits = model(src_ids, src_mask, tgt_in)
        total_nll += F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID,
                                     reduction="sum").item()  # fmt: skip
        total_tokens += int((tgt_out != PAD_ID).sum())
    return math.exp(total_nll / total_tokens)


def has_repeated_4gram(text: str) -> bool:
    words = text.split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(grams) != len(set(grams))


def scores(hypotheses: list[str], references: list[str]) -> dict:
    bleu = sacrebleu.BLEU().corpus_score(hypotheses, [references])
    chrf = sacrebleu.CHRF().corpus_score(hypotheses, [references])
    n = len(hypotheses)
    return {
        "sentences": n,
        "bleu": round(bleu.score, 2),
        "chrf": round(chrf.score, 2),
        "length_ratio": round(bleu.sys_len / max(1, bleu.ref_len), 3),
        "repeat4": round(sum(map(has_repeated_4gram, hypotheses)) / n, 3),
        "repeat4_ref": round(sum(map(has_repeated_4gram, references)) / n, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="LABEL=CHECKPOINT, repeatable")
    parser.add_argument("--data", type=Path, default=REPO / ".cache" / "data" / "ende")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--no-repeat-ngram", type=int, default=0)
    parser.add_argument("--length-limit", type=lambda s: (float(s.split(",")[0]), int(s.split(",")[1])),
                        help="RATIO,EXTRA: stop each sentence at RATIO x source tokens + EXTRA")  # fmt: skip
    parser.add_argument("--sets", nargs="+", help="only these sets (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="translate-domains")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()

    sp = spm.SentencePieceProcessor(model_file=str(args.data / "spm.model"))
    test = read_test(args.data / "test.tsv")
    rows, bucket_rows, summary_rows = [], [], []
    for spec in args.model:
        label, checkpoint = spec.rsplit("=", 1)
        model, saved = load_trained(Path(checkpoint), Translator)
        trained_with = saved.get("extra", {}).get("data_meta", {}).get("sha256", {}).get("spm.model")
        if trained_with and trained_with != sha256_of(args.data / "spm.model"):
            raise ValueError(f"{checkpoint} was trained with another tokenizer than {args.data}'s")
        sets = dict(test)
        for source in LONG_SOURCES:
            sets[f"{source}-long"] = joined_pairs(test[source], lambda text: len(sp.encode(text)), model.cfg.n_max)
        per_sentence = []  # (source tokens, hypothesis, reference)
        outputs: dict[str, tuple[list[str], list[str]]] = {}
        for set_name, pairs in sets.items():
            if args.sets and set_name not in args.sets:
                continue
            started = time.perf_counter()
            hypotheses = translate(model, sp, [en for en, _ in pairs], args)
            seconds = time.perf_counter() - started
            references = [de for _, de in pairs]
            outputs[set_name] = (hypotheses, references)
            rows.append({"model": label, "set": set_name, **scores(hypotheses, references),
                         "decode_s": round(seconds, 1), "checkpoint": checkpoint})  # fmt: skip
            per_sentence += [(len(sp.encode(en)), hyp, ref) for (en, _), hyp, ref in zip(pairs, hypotheses, references,
                                                                                        strict=True)]  # fmt: skip
            print(rows[-1], flush=True)
        if "help" in outputs and "ding" in outputs:  # the 1,500-pair test split of the first data version
            hypotheses, references = (outputs["help"][i] + outputs["ding"][i] for i in (0, 1))
            rows.append({"model": label, "set": "help+ding", **scores(hypotheses, references),
                         "checkpoint": checkpoint})  # fmt: skip
        summary_rows.append({"model": label, "dev_ppl": round(dev_perplexity(model, sp, args.data / "dev.tsv"), 2),
                             **{f"bleu_{r['set']}": r["bleu"] for r in rows if r["model"] == label},
                             "checkpoint": checkpoint})  # fmt: skip
        for low, high in BUCKETS:
            chosen = [(hyp, ref) for length, hyp, ref in per_sentence if low <= length <= high]
            if chosen:
                hyps, refs = zip(*chosen, strict=True)
                bucket_rows.append({"model": label, "bucket": f"{low}-{high}", **scores(list(hyps), list(refs))})

    limit = f"{args.length_limit[0]:.2f} x source + {args.length_limit[1]}" if args.length_limit else "off"
    options = (f"beam {args.beam} (GNMT length penalty alpha 0.6), batches of {args.batch_size}, max_new_tokens "
               f"{args.max_new_tokens}, no-repeat n-gram {args.no_repeat_ngram or 'off'}, length limit "
               f"{limit}, {args.threads} thread(s)")
    write_csv(args.out / f"{args.name}.csv", [{**r, "options": options} for r in rows]
              + [{**r, "set": "bucket " + r["bucket"], "options": options} for r in bucket_rows])  # fmt: skip
    lines = header(f"EN->DE per domain: {args.name}", ("torch", "sacrebleu", "sentencepiece"), load_before)
    lines += [f"- decoding: {options}", f"- data: `{args.data}` (test split; `-long` sets joined as the docstring "
              "says); dev PPL on its dev split", "", "## Summary (BLEU)", ""]  # fmt: skip
    lines += markdown_table(summary_rows, {"model": "model", "dev_ppl": "PPL (dev)", "bleu_help": "help",
                                           "bleu_ding": "Ding", "bleu_desc": "desc", "bleu_help+ding": "help+Ding",
                                           "bleu_help-long": "help-long", "bleu_desc-long": "desc-long",
                                           "checkpoint": "checkpoint"})  # fmt: skip
    lines += ["", "## Per held-out set", ""]
    columns = {"model": "model", "set": "set", "sentences": "sentences", "bleu": "BLEU", "chrf": "chrF",
               "length_ratio": "hyp/ref length", "repeat4": "repeated 4-gram", "repeat4_ref": "(references)",
               "decode_s": "decode s"}  # fmt: skip
    lines += markdown_table(rows, columns)
    lines += ["", "## Per source-length bucket (tokens, all sets)", ""]
    lines += markdown_table(bucket_rows, {"model": "model", "bucket": "source tokens", **{k: v for k, v in
                                          columns.items() if k not in ("model", "set", "decode_s")}})  # fmt: skip
    write_markdown(args.out / f"{args.name}.md", [*lines, ""])  # this report has always ended in a newline
    plot(bucket_rows, args.out / f"{args.name}.png", options)


def plot(bucket_rows: list[dict], path: Path, options: str) -> None:
    fig, (ax_bleu, ax_ratio) = agg_subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(r["model"] for r in bucket_rows):
        mine = [r for r in bucket_rows if r["model"] == label]
        ax_bleu.plot([r["bucket"] for r in mine], [r["bleu"] for r in mine], marker="o", label=label)
        ax_ratio.plot([r["bucket"] for r in mine], [r["length_ratio"] for r in mine], marker="o", label=label)
    ax_ratio.axhspan(0.9, 1.2, color="green", alpha=0.1, label="goal 0.9-1.2")
    ax_bleu.set(xlabel="source tokens", ylabel="BLEU", title="BLEU per source length")
    ax_ratio.set(xlabel="source tokens", ylabel="hypothesis / reference length", title="Length ratio")
    ax_bleu.legend(fontsize=7)
    ax_ratio.legend(fontsize=7)
    fig.suptitle(options, fontsize=7)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
