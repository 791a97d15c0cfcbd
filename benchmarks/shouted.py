"""Text written all in capitals, through the service's text handling (a benchmark).

People write in capitals (a heading, a warning, an angry review); both kinds of model learnt from ordinarily cased
text. Measured here on held-out data, each text as written and in capitals (str.upper()): /translate's BLEU on the
first help test sources of 4-40 words (in capitals against the references in capitals), decoded as /translate
decodes them (the service's runtime, greedy, sentence by sentence), and /classify's accuracy on the first test
reviews of each source, computed as benchmarks/classify_eval.py does. "before": read as written, as the service
did before it read capitals in sentence case (the tokenizer of service/ at `--baseline`; for /classify, the
bundle's tokenizer alone); "now": this tree.

    .venv/bin/python benchmarks/shouted.py [--baseline e3032cc]

Writes benchmarks/results/shouted.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import sacrebleu

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.classify_eval import bundle_predictions  # noqa: E402
from benchmarks.int8 import translator  # noqa: E402
from benchmarks.translate_domains import read_test  # noqa: E402
from benchmarks.translate_paragraphs import translate  # noqa: E402
from benchmarks.translate_symbols import tokenizer_module_at  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service import tokenizer as this_tree  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from training.classify import read_split_with_source  # noqa: E402


def translation_rows(models: list[str], models_dir: Path, data: Path, count: int, before) -> list[dict]:
    pairs = [(en, de) for en, de in read_test(data / "test.tsv")["help"] if 4 <= len(en.split()) <= 40][:count]
    sources, references = [en for en, _ in pairs], [de for _, de in pairs]
    rows = []
    for name in models:
        bundle = load_bundle(models_dir / name)
        runtime = translator(bundle)
        for case, texts, refs, module in (
            ("as written", sources, references, this_tree),
            ("in capitals, before", [s.upper() for s in sources], [r.upper() for r in references], before),
            ("in capitals, now", [s.upper() for s in sources], [r.upper() for r in references], this_tree),
        ):
            out = translate(module.Tokenizer.from_bundle(bundle), runtime, bundle.pad_id, texts, split=True)
            rows.append({"task": "translate", "model": name, "case": case, "texts": len(texts),
                         "score": round(sacrebleu.corpus_bleu(out, [refs]).score, 2), "metric": "BLEU"})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def classification_rows(models: list[str], models_dir: Path, data: Path, count: int) -> list[dict]:
    test = read_split_with_source(data / "test.tsv")
    chosen = [row for source in ("imdb", "rotten_tomatoes") for row in [r for r in test if r[2] == source][:count]]
    labels, texts = np.array([label for label, _, _ in chosen]), [text for _, text, _ in chosen]
    as_written = lambda tokenizer, batch: tokenizer.encode_all(batch, truncate=True)  # noqa: E731
    rows = []
    for name in models:
        for case, batch, encode in (("as written", texts, None), ("in capitals, before", [t.upper() for t in texts],
                                    as_written), ("in capitals, now", [t.upper() for t in texts], None)):  # fmt: skip
            predicted = (bundle_predictions(models_dir / name, batch, threads=1, encode=encode) >= 0.5).astype(int)
            accuracy = round(100 * float((predicted == labels).mean()), 2)
            rows.append({"task": "classify", "model": name, "case": case, "texts": len(batch), "score": accuracy,
                         "metric": "accuracy %"})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/shouted.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--translate-models", default="translate-linformer,translate-transformer")
    parser.add_argument("--classify-models", default="classify-linformer,classify-transformer")
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--ende", type=Path, default=REPO / ".cache" / "data" / "ende")
    parser.add_argument("--reviews", type=Path, default=REPO / ".cache" / "data" / "reviews")
    parser.add_argument("--sentences", type=int, default=300, help="help test sources")
    parser.add_argument("--reviews-per-source", type=int, default=250, help="test reviews of IMDB and of RT each")
    parser.add_argument("--baseline", default="e3032cc", help="service/tokenizer.py before capitals were recased")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    load_before = load_average()
    before = tokenizer_module_at(args.baseline, Path(tempfile.mkdtemp()))
    rows = translation_rows(args.translate_models.split(","), args.models_dir, args.ende, args.sentences, before)
    rows += classification_rows(args.classify_models.split(","), args.models_dir, args.reviews,
                                args.reviews_per_source)  # fmt: skip
    write_report(args.out / "shouted", rows, load_before)


def write_report(stem: Path, rows: list[dict], load_before: str) -> None:
    write_csv(stem.with_suffix(".csv"), rows)
    lines = header("Text written all in capitals through the service's text handling",
                   ("onnxruntime", "sentencepiece", "sacrebleu"), load_before)  # fmt: skip
    lines += [__doc__.split("\n\n")[1], "",
              *markdown_table(rows, {"task": "route", "model": "bundle", "case": "texts", "texts": "count",
                                     "metric": "metric", "score": "score"}),
              "", f"![scores as written and in capitals]({stem.name}.png)", ""]  # fmt: skip
    write_markdown(stem.with_suffix(".md"), lines)
    fig, axes = agg_subplots(1, 2, figsize=(12, 4.2))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for ax, task in zip(axes, ("translate", "classify"), strict=True):
        models = list(dict.fromkeys(r["model"] for r in rows if r["task"] == task))
        x, width = np.arange(len(models)), 0.8 / len(cases)
        for c, case in enumerate(cases):
            values = [next(r["score"] for r in rows if (r["task"], r["model"], r["case"]) == (task, m, case))
                      for m in models]  # fmt: skip
            ax.bar(x + c * width, values, width, label=case)
        ax.set_xticks(x + width * (len(cases) - 1) / 2, models, fontsize=8)
        ax.set_title(f"/{task}: {next(r['metric'] for r in rows if r['task'] == task)}")
        ax.legend(fontsize=7, loc="lower center")
    save_figure(fig, stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
