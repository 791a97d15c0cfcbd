"""Served classifiers against the bag-of-words floor, per source and per length bucket (a benchmark, not a test).

Each bundle is run as the service runs it (its tokenizer, `truncate: true`, its ONNX model under ONNX
Runtime). The floor is TF-IDF (word 1-2-grams) + logistic regression trained on the same training split,
its C chosen on dev. Buckets count tokens with one tokenizer for every model (the first bundle's), so a
text sits in the same bucket for every row.

    python benchmarks/classify_eval.py --data .cache/data/reviews \
        --bundles models/classify-linformer models/classify-transformer

Writes benchmarks/results/classify-eval.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

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
from service.bundle import load_bundle  # noqa: E402
from service.runtime import ClassifierRuntime, make_session  # noqa: E402
from service.tokenizer import Encoded, Tokenizer  # noqa: E402
from training.batching import bucketed_batches, pad  # noqa: E402
from training.classify import read_split_with_source  # noqa: E402

BUCKETS = (("≤ 32 tokens", 0, 32), ("33–256 tokens", 33, 256), ("> 256 tokens", 257, 1 << 30))
SOURCES = ("imdb", "rotten_tomatoes")


Encode = Callable[[Tokenizer, list[str]], list[Encoded]]


def bundle_predictions(bundle_dir: Path, texts: list[str], threads: int, max_tokens: int = 16384,
                       encode: Encode | None = None) -> np.ndarray:  # fmt: skip
    """P(positive) per text, encoded as /classify encodes them (or by `encode`) and computed in length-sorted batches
    exactly as the service pads them."""
    bundle = load_bundle(bundle_dir)
    tokenizer = Tokenizer.from_bundle(bundle)
    runtime = ClassifierRuntime(make_session(bundle.onnx_path("model"), ["CPUExecutionProvider"],
                                             intra_op_threads=threads, inter_op_threads=1))  # fmt: skip
    encoded = encode(tokenizer, texts) if encode else tokenizer.encode_to_classify(texts, truncate=True)
    ids = [e.ids for e in encoded]
    positive = bundle.labels.index("positive")
    scores = np.zeros(len(texts))
    for rows in bucketed_batches([len(i) for i in ids], max_tokens, max_batch=256):  # sorted by length
        batch, mask = pad([ids[i] for i in rows], bundle.pad_id)
        logits = runtime.run(batch.numpy(), mask.numpy())
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores[rows] = exp[:, positive] / exp.sum(axis=1)
    return scores


def tfidf_predictions(train: list[tuple[int, str, str]], dev, test) -> tuple[np.ndarray, dict]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, max_features=500_000)
    x_train = vectorizer.fit_transform([t for _, t, _ in train])
    y_train = [y for y, _, _ in train]
    best = None
    for c in (1.0, 4.0, 16.0):
        model = LogisticRegression(C=c, max_iter=2000).fit(x_train, y_train)
        dev_accuracy = model.score(vectorizer.transform([t for _, t, _ in dev]), [y for y, _, _ in dev])
        if best is None or dev_accuracy > best[0]:
            best = (dev_accuracy, c, model)
    _, c, model = best
    return model.predict_proba(vectorizer.transform([t for _, t, _ in test]))[:, 1], {"C": c}


def score_rows(name: str, scores: np.ndarray, labels: np.ndarray, sources: list[str], lengths: np.ndarray) -> dict:
    correct = (scores >= 0.5).astype(int) == labels
    row = {"model": name, "all": float(correct.mean()), "n": len(labels)}
    for source in SOURCES:
        chosen = np.array([s == source for s in sources])
        row[source] = float(correct[chosen].mean()) if chosen.any() else None
    for bucket, low, high in BUCKETS:
        chosen = (lengths >= low) & (lengths <= high)
        row[bucket] = float(correct[chosen].mean()) if chosen.any() else None
        row[f"n {bucket}"] = int(chosen.sum())
    return row


def plot(rows: list[dict], path: Path) -> None:
    groups = ["imdb", "rotten_tomatoes", *(b for b, _, _ in BUCKETS)]
    fig, ax = agg_subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        values = [100 * (row[g] if row[g] is not None else np.nan) for g in groups]
        ax.bar(np.arange(len(groups)) + i * width, values, width, label=row["model"])
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, ["IMDB", "Rotten Tomatoes", *groups[2:]])
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(50, 100)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Classification test accuracy per source and length bucket")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(".cache/data/reviews"))
    parser.add_argument("--bundles", type=Path, nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "classify-eval")
    args = parser.parse_args(argv)
    load_before = load_average()

    train, dev, test = (read_split_with_source(args.data / f"{split}.tsv") for split in ("train", "dev", "test"))
    texts = [t for _, t, _ in test]
    labels = np.array([y for y, _, _ in test])
    sources = [s for _, _, s in test]
    bucket_tokenizer = Tokenizer.from_bundle(load_bundle(args.bundles[0]))
    lengths = np.array([len(e.ids) for e in bucket_tokenizer.encode_all(texts, truncate=True)])

    rows = []
    started = time.perf_counter()
    scores, chosen = tfidf_predictions(train, dev, test)
    rows.append(score_rows(f"TF-IDF + logistic regression (C={chosen['C']:g})", scores, labels, sources, lengths))
    rows[-1]["seconds"] = round(time.perf_counter() - started, 1)
    for bundle in args.bundles:
        started = time.perf_counter()
        rows.append(score_rows(bundle.name, bundle_predictions(bundle, texts, args.threads), labels, sources, lengths))
        rows[-1]["seconds"] = round(time.perf_counter() - started, 1)

    write_csv(args.out.with_suffix(".csv"), rows)
    columns = {"model": "model", "all": "all", "imdb": "IMDB", "rotten_tomatoes": "Rotten Tomatoes",
               **{b: b for b, _, _ in BUCKETS}}  # fmt: skip
    counts = ", ".join(f"{b}: {rows[0][f'n {b}']}" for b, _, _ in BUCKETS)
    lines = header("Classification test accuracy per source and length bucket", ("onnxruntime", "scikit-learn"),
                   load_before)  # fmt: skip
    lines += [
        f"Test split of `{args.data}` ({len(texts)} texts: "
        + ", ".join(f"{s} {sources.count(s)}" for s in SOURCES) + f"); buckets by `{args.bundles[0].name}`'s "
        f"tokenizer, BOS included ({counts}). The floor is trained on the same training split "
        f"({len(train)} texts), C chosen on dev. Bundles run as served (`truncate: true`). Test accuracy:",
        "",
        *markdown_table([{k: f"{100 * v:.1f} %" if k in columns and isinstance(v, float) else v
                          for k, v in row.items()} for row in rows], columns),  # fmt: skip
        "",
        f"![accuracy by source and length]({args.out.name}.png)",
        "",
    ]
    write_markdown(args.out.with_suffix(".md"), lines)
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
