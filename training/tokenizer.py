"""Train SentencePiece models with the special ids every model in this project shares.

The ids are fixed here so that training, export and serving agree on them without reading
each other's code: padding is 0 (so a zeroed tensor is all padding), then unk, bos, eos.

    python -m training.tokenizer --input .cache/data/imdb/train.tsv --column text \
        --vocab-size 8000 --out .cache/data/imdb/spm
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

# Reviews are long (up to ~14k characters); SentencePiece silently skips any input line longer
# than max_sentence_length bytes, so the limit must be far above the default of 4192.
MAX_SENTENCE_BYTES = 1 << 16


def train_sentencepiece(
    sentences: Iterable[str],
    model_prefix: Path,
    vocab_size: int,
    *,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = 300_000,
    seed: int = 1234,
    num_threads: int = 2,
) -> Path:
    """Train a model on `sentences` and return the path of `<model_prefix>.model`.

    `input_sentence_size` caps how many lines SentencePiece samples (shuffled, with `seed`), which
    keeps training to a minute or two on two cores whatever the corpus size.
    """
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe', got {model_type!r}")
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    # The sampling of input sentences uses SentencePiece's global generator; seeding it makes
    # the model file byte-for-byte reproducible.
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_non_empty(sentences),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        minloglevel=2,
    )
    return model_prefix.with_name(model_prefix.name + ".model")


def read_tsv_column(path: Path, column: str) -> Iterator[str]:
    """Yield one column of a prepared TSV file (header row first, no quoting)."""
    with path.open(encoding="utf-8", newline="") as f:
        yield from (row[column] for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def _non_empty(sentences: Iterable[str]) -> Iterator[str]:
    return (s for s in sentences if s.strip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, nargs="+", required=True, help="prepared TSV file(s)")
    parser.add_argument("--column", nargs="+", default=["text"], help="column(s) to train on")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=["unigram", "bpe"], default="unigram")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--input-sentence-size", type=int, default=300_000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, required=True, help="model prefix, e.g. .cache/data/imdb/spm")
    args = parser.parse_args(argv)

    sentences = (
        text for path in args.input for column in args.column for text in read_tsv_column(path, column)
    )
    model_path = train_sentencepiece(
        sentences,
        args.out,
        args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        input_sentence_size=args.input_sentence_size,
        seed=args.seed,
    )
    print(model_path, file=sys.stderr)


if __name__ == "__main__":
    main()
