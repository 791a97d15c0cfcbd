"""A tiny EN->DE-shaped data directory (same files as training/ende.py writes), made in seconds.

The "translation" maps English number words to German ones in the same order, so a small model learns
it in a few hundred steps and its greedy output can be checked word for word.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from training.tokenizer import train_sentencepiece

EN_TO_DE = {
    "one": "eins", "two": "zwei", "three": "drei", "four": "vier", "five": "fünf", "six": "sechs",
    "seven": "sieben", "eight": "acht", "nine": "neun", "ten": "zehn", "red": "rot", "blue": "blau",
}  # fmt: skip


def pair(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(list(EN_TO_DE)) for _ in range(rng.randint(1, 3))]
    return " ".join(words), " ".join(EN_TO_DE[w] for w in words)


def make_tiny_ende(out: Path, rows: int = 3000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": rows, "dev": 100, "test": 100}
    sentences = []
    for split, n in sizes.items():
        lines = ["source\ten\tde"]
        for _ in range(n):
            en, de = pair(rng)
            sentences += [en, de]
            lines.append(f"synthetic\t{en}\t{de}")
        (out / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    train_sentencepiece(sentences, out / "spm", vocab_size=50, num_threads=1)
    meta = {"dataset": "tiny-synthetic-ende", "tokenizer": {"vocab_size": 50}, "counts": sizes, "seed": seed}
    (out / "meta.json").write_text(json.dumps(meta))
    return out
