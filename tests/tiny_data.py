"""A tiny IMDB-shaped data directory (same files as training/imdb.py writes), made in seconds."""

from __future__ import annotations

import json
import random
from pathlib import Path

from training.tokenizer import train_sentencepiece

POSITIVE = ["great", "wonderful", "loved", "brilliant", "moving", "superb"]
NEGATIVE = ["awful", "boring", "hated", "dull", "terrible", "waste"]
FILLER = ["the", "film", "plot", "actor", "scene", "story", "was", "and", "a", "it", "this", "of"]


def review(rng: random.Random, label: int) -> str:
    words = [rng.choice(FILLER) for _ in range(rng.randint(5, 60))]
    for _ in range(3):
        words.insert(rng.randrange(len(words)), rng.choice(POSITIVE if label else NEGATIVE))
    return " ".join(words)


def make_tiny_imdb(out: Path, rows: int = 240, seed: int = 0) -> Path:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": rows, "dev": rows // 4, "test": rows // 4}
    texts = []
    for split, n in sizes.items():
        lines = ["label\ttext"]
        for i in range(n):
            text = review(rng, i % 2)
            texts.append(text)
            lines.append(f"{i % 2}\t{text}")
        (out / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    train_sentencepiece(texts, out / "spm", vocab_size=48, num_threads=1)
    meta = {"dataset": "tiny-synthetic", "tokenizer": {"vocab_size": 48}, "counts": sizes}
    (out / "meta.json").write_text(json.dumps(meta))
    return out
