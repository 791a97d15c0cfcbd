"""Sentences with several symbols the vocabulary cannot spell, through /translate's text handling (a benchmark).

/translate replaces what the vocabulary cannot spell (an emoji, a symbol) by a placeholder {n} and puts it back in
the translation (service/tokenizer.py). With several in one sentence the translators write some placeholders
broken ("🙂}}", "{4eat}", "Grate8}"). Counted here, on the first help test sources of 8-40 words without braces of
their own, each with k symbols inserted at seeded word positions (k = 1, 3, 6, 10), or 5 symbols as one run with
spaces between them: how many translations have a brace that was not in the source, and how many carry every
inserted symbol. Decoded as /translate decodes (the service's runtime, greedy, sentence by sentence); each model's
outputs are decoded once per tokenizer, that of this tree and, with `--baseline REF`, that of service/ at REF.

    .venv/bin/python benchmarks/translate_symbols.py [--baseline 441fd78] [--models translate-linformer]

Writes benchmarks/results/translate-symbols.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.int8 import translator  # noqa: E402
from benchmarks.loadgen import service_at  # noqa: E402
from benchmarks.translate_domains import read_test  # noqa: E402
from benchmarks.translate_paragraphs import translate  # noqa: E402
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

SYMBOLS = ("🙂", "🎉", "✓", "★", "♥", "😀", "👍", "🔥", "✨", "💾")
CASES = ((1, False), (3, False), (6, False), (10, False), (5, True))  # (symbols, as one spaced run)


def with_symbols(sources: list[str], count: int, one_run: bool) -> list[tuple[str, list[str]]]:
    """Each source with `count` symbols inserted at seeded word positions (or as one run, spaces between them)."""
    marked = []
    for i, text in enumerate(sources):
        rng = random.Random(1000 * count + i)
        words, symbols = text.split(), [rng.choice(SYMBOLS) for _ in range(count)]
        if one_run:
            at = rng.randrange(1, len(words))
            words = [*words[:at], " ".join(symbols), *words[at:]]
        else:
            for symbol in symbols:
                words.insert(rng.randrange(1, len(words) + 1), symbol)
        marked.append((" ".join(words), symbols))
    return marked


def tokenizer_module_at(ref: str, into: Path):
    """service/tokenizer.py as it was at git `ref`, imported under its own name beside this tree's."""
    path = service_at(ref, into) / "service" / "tokenizer.py"
    spec = importlib.util.spec_from_file_location(f"tokenizer_at_{ref}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/translate_symbols.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="translate-linformer,translate-transformer")
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--data", type=Path, default=REPO / ".cache" / "data" / "ende")
    parser.add_argument("--count", type=int, default=100, help="sources per case")
    parser.add_argument("--baseline", help="also service/tokenizer.py at this git ref")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    load_before = load_average()
    tokenizers = {"this tree": this_tree}
    if args.baseline:
        tokenizers[f"at {args.baseline}"] = tokenizer_module_at(args.baseline, Path(tempfile.mkdtemp()))
    help_sources = [en for en, _ in read_test(args.data / "test.tsv")["help"]
                    if 8 <= len(en.split()) <= 40 and "{" not in en and "}" not in en][: args.count]  # fmt: skip
    rows = []
    for name in args.models.split(","):
        bundle = load_bundle(args.models_dir / name)
        runtime = translator(bundle)
        for tree, module in tokenizers.items():
            tokenizer = module.Tokenizer.from_bundle(bundle)
            for count, one_run in CASES:
                marked = with_symbols(help_sources, count, one_run)
                out = translate(tokenizer, runtime, bundle.pad_id, [text for text, _ in marked], split=True)
                rows.append({
                    "model": name, "tokenizer": tree, "symbols": count, "one_run": one_run, "texts": len(out),
                    "stray_brace": sum("{" in t or "}" in t for t in out),
                    "all_carried": sum(all(t.count(s) >= symbols.count(s) for s in symbols)
                                       for t, (_, symbols) in zip(out, marked, strict=True)),
                })  # fmt: skip
                print(rows[-1], flush=True)
    write_report(args.out / "translate-symbols", rows, load_before)


def write_report(stem: Path, rows: list[dict], load_before: str) -> None:
    write_csv(stem.with_suffix(".csv"), rows)
    for row in rows:
        row["case"] = f"{row['symbols']}" + (" as one run" if row["one_run"] else "")
    lines = header("Sentences with several symbols through /translate's text handling",
                   ("onnxruntime", "sentencepiece", "numpy"), load_before)  # fmt: skip
    lines += [__doc__.split("\n\n")[1], "",
              *markdown_table(rows, {"model": "bundle", "tokenizer": "service/tokenizer.py", "case": "symbols",
                                     "texts": "texts", "stray_brace": "with a brace not in the source",
                                     "all_carried": "carrying every symbol"}),
              "", f"![stray braces and symbols carried]({stem.name}.png)", ""]  # fmt: skip
    write_markdown(stem.with_suffix(".md"), lines)
    fig, axes = agg_subplots(1, 2, figsize=(12, 4.2))
    groups = list(dict.fromkeys((r["model"], r["tokenizer"]) for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    x, width = np.arange(len(cases)), 0.8 / len(groups)
    panels = (("stray_brace", "translations with a stray brace"), ("all_carried", "translations carrying every symbol"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for g, (model, tree) in enumerate(groups):
            values = [next(r[key] for r in rows if (r["model"], r["tokenizer"], r["case"]) == (model, tree, case))
                      for case in cases]  # fmt: skip
            ax.bar(x + g * width, values, width, label=f"{model.removeprefix('translate-')}, {tree}")
        ax.set_xticks(x + width * (len(groups) - 1) / 2, [f"{c} symbols" for c in cases], fontsize=8)
        ax.set_title(f"{title} (of {rows[0]['texts']})")
        ax.legend(fontsize=7)
    save_figure(fig, stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
