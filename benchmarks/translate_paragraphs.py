"""Texts of several sentences through the served translation bundles: each text in one piece (`"split_sentences":
false`) against sentence by sentence (the /translate default), BLEU and chrF on held-out sets (a benchmark).

The bundles decode as /translate does (service/runtime.py's TranslatorRuntime, the service tokenizer, greedy: the
API's default beam, truncation to n_max), each row alone in length-sorted batches of 32; sentence splitting is
service/tokenizer.py's `split_sentences`, joined again with the text's own spacing. Sets, from the prepared test
split (`python -m training.ende`), none of whose text is in training:
- `help`, `desc`, `ding`: the test sources as they are (help paragraphs, package descriptions, Ding sentences);
  `help multi`, `desc multi`: only those of more than one sentence (the others translate identically either way,
  which the run checks);
- `ding x3`: three consecutive Ding sentences joined by a space (a short paragraph of everyday sentences);
- `help x2 lines`: two consecutive help sources joined by a line break, as a user pastes two lines.
Joined sets join the references the same way; line breaks are scored as spaces.

    .venv/bin/python benchmarks/translate_paragraphs.py [--models translate-linformer,translate-transformer]

Also: what the vocabulary cannot spell (an emoji, a name in another script), and a web and an e-mail address,
inserted into help sources, and how many translations carry it over. Writes
benchmarks/results/translate-paragraphs{,-unknowns}.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.int8 import decode_in_batches, translator  # noqa: E402
from benchmarks.translate_domains import read_test, scores  # noqa: E402
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
from service.tokenizer import Tokenizer, split_sentences  # noqa: E402

# an emoji; a name in another script; a web and an e-mail address (the training data has none)
MARKS = ("😀", "李明", "https://help.libreoffice.org/latest/en-US/text/main.html", "users@global.libreoffice.org")


def translate(tokenizer: Tokenizer, runtime, pad_id: int, texts: list[str], split: bool) -> list[str]:
    """Texts -> translations as /translate makes them (service/tokenizer.py's translation_sources and
    translations around the runtime), with or without sentence splitting."""
    sources = tokenizer.translation_sources(texts, split=split, truncate=True)
    outputs = decode_in_batches(runtime, [source.encoded.ids for source in sources], pad_id)
    return [translation["text"] for translation in tokenizer.translations(sources, outputs)]


def with_mark(pairs: list[tuple[str, str]], mark: str, count: int = 200) -> list[str]:
    """The first `count` sources of 5-40 words, each with `mark` inserted before a word chosen by a seeded draw."""
    sources = [en for en, _ in pairs if 5 <= len(en.split()) <= 40][:count]
    marked = []
    for i, text in enumerate(sources):
        words = text.split()
        at = random.Random(i).randrange(1, len(words))
        marked.append(" ".join([*words[:at], mark, *words[at:]]))
    return marked


def carried(tokenizer: Tokenizer, runtime, pad_id: int, texts: list[str], mark: str) -> dict:
    """How many translations hold `mark` exactly once: as /translate makes them (placeholders), and with the source
    encoded as it is (an unknown piece the model writes gets the source's, in order)."""
    service = translate(tokenizer, runtime, pad_id, texts, split=True)
    encoded = tokenizer.encode_all(texts, truncate=True)
    outputs = decode_in_batches(runtime, [e.ids for e in encoded], pad_id)
    plain = [tokenizer.decode(out, e.unknowns) for e, out in zip(encoded, outputs, strict=True)]
    return {"texts": len(texts), "placeholders": sum(t.count(mark) == 1 for t in service),
            "unknown_piece": sum(t.count(mark) == 1 for t in plain)}  # fmt: skip


def joined(pairs: list[tuple[str, str]], k: int, separator: str) -> list[tuple[str, str]]:
    """Consecutive groups of k pairs, sources and references each joined by the separator (the rest dropped)."""
    return [(separator.join(en for en, _ in pairs[i : i + k]), separator.join(de for _, de in pairs[i : i + k]))
            for i in range(0, len(pairs) - k + 1, k)]  # fmt: skip


def sets(test: dict[str, list[tuple[str, str]]]) -> dict[str, list[tuple[str, str]]]:
    multi = {f"{name} multi": [p for p in test[name] if len(split_sentences(p[0])) > 1] for name in ("help", "desc")}
    return {"help": test["help"], **{"help multi": multi["help multi"]}, "desc": test["desc"],
            **{"desc multi": multi["desc multi"]}, "ding": test["ding"], "ding x3": joined(test["ding"], 3, " "),
            "help x2 lines": joined(test["help"], 2, "\n")}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/translate_paragraphs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="translate-linformer,translate-transformer")
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--data", type=Path, default=REPO / ".cache" / "data" / "ende")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--name", default="translate-paragraphs")
    args = parser.parse_args(argv)
    load_before = load_average()
    test = sets(read_test(args.data / "test.tsv"))
    rows, marks = [], []
    for name in args.models.split(","):
        bundle = load_bundle(args.models_dir / name)
        tokenizer, runtime = Tokenizer.from_bundle(bundle), translator(bundle)
        for set_name, pairs in test.items():
            sources, references = [en for en, _ in pairs], [de.replace("\n", " ") for _, de in pairs]
            whole = translate(tokenizer, runtime, bundle.pad_id, sources, split=False)
            split = translate(tokenizer, runtime, bundle.pad_id, sources, split=True)
            if set_name in ("help", "desc"):  # a text of one sentence is the same row either way
                single = [i for i, text in enumerate(sources) if len(split_sentences(text)) == 1]
                assert all(whole[i] == split[i] for i in single), f"{name} {set_name}: a one-sentence text differs"
            texts = sum(len(split_sentences(s)) for s in sources)
            for mode, hypotheses in (("whole", whole), ("sentences", split)):
                rows.append({"model": name, "set": set_name, "mode": mode, "texts": len(sources),
                             "sentences_in_sources": texts,
                             **scores([h.replace("\n", " ") for h in hypotheses], references)})  # fmt: skip
                print(rows[-1], flush=True)
        for mark in MARKS:
            texts = with_mark(test["help"], mark)
            marks.append({"model": name, "mark": mark, **carried(tokenizer, runtime, bundle.pad_id, texts, mark)})
            print(marks[-1], flush=True)
    write_report(args, rows, marks, load_before)


def write_report(args: argparse.Namespace, rows: list[dict], marks: list[dict], load_before: str) -> None:
    stem = args.out / args.name
    write_csv(stem.with_suffix(".csv"), rows)
    write_csv(stem.with_name(f"{stem.name}-unknowns.csv"), marks)
    by = {(r["model"], r["set"], r["mode"]): r for r in rows}
    pairs = [{"model": m, "set": s, "texts": by[m, s, "whole"]["texts"],
              "sentences": by[m, s, "whole"]["sentences_in_sources"],
              "bleu_whole": by[m, s, "whole"]["bleu"], "bleu_split": by[m, s, "sentences"]["bleu"],
              "chrf_whole": by[m, s, "whole"]["chrf"], "chrf_split": by[m, s, "sentences"]["chrf"],
              "len_whole": by[m, s, "whole"]["length_ratio"], "len_split": by[m, s, "sentences"]["length_ratio"],
              "rep_whole": by[m, s, "whole"]["repeat4"], "rep_split": by[m, s, "sentences"]["repeat4"]}
             for m, s, mode in by if mode == "whole"]  # fmt: skip
    lines = header("Texts of several sentences: translated whole or sentence by sentence", ("onnxruntime",
                   "sentencepiece", "sacrebleu", "numpy"), load_before)  # fmt: skip
    lines += [__doc__.split("\n\n")[1], "",
              *markdown_table(pairs, {"model": "bundle", "set": "set", "texts": "texts", "sentences": "sentences",
                                      "bleu_whole": "BLEU whole", "bleu_split": "BLEU by sentence",
                                      "chrf_whole": "chrF whole", "chrf_split": "chrF by sentence",
                                      "len_whole": "length ratio whole", "len_split": "length ratio by sentence",
                                      "rep_whole": "repeat4 whole", "rep_split": "repeat4 by sentence"}),
              "", "Length ratio: the hypotheses' length over the references' (sacrebleu 13a tokens): below 1, words "
              "are missing. repeat4: the share of translations in which some word 4-gram occurs twice (the "
              "references': 0-5 %).", "",
              "## What the vocabulary cannot spell, and addresses", "",
              f"The first 200 help test sources of 5-40 words, each with one mark inserted before a seeded word "
              f"({', '.join(MARKS[:2])}: characters the tokenizer has no piece for; {', '.join(MARKS[2:])}: a web "
              "and an e-mail address, which the training data has none of); how many translations hold it "
              "exactly once, as /translate makes them (the mark replaced by a placeholder {1} in the source, and "
              "back in the translation) and with the source as it is (an unknown piece the model writes gets the "
              "source's text, in order).", "",
              *markdown_table(marks, {"model": "bundle", "mark": "mark", "texts": "texts",
                                      "placeholders": "carried (placeholder, /translate)",
                                      "unknown_piece": "carried (source as it is)"}), "",
              f"![BLEU whole vs by sentence]({stem.name}.png)", ""]  # fmt: skip
    write_markdown(stem.with_suffix(".md"), lines)
    fig, axes = agg_subplots(1, 2, figsize=(12, 4.2))
    for ax, (key, title) in zip(axes, (("bleu", "BLEU"), ("chrf", "chrF")), strict=True):
        labels = [f"{p['model'].removeprefix('translate-')}\n{p['set']}" for p in pairs]
        x = np.arange(len(pairs))
        ax.bar(x - 0.2, [p[f"{key}_whole"] for p in pairs], 0.4, label="whole text")
        ax.bar(x + 0.2, [p[f"{key}_split"] for p in pairs], 0.4, label="sentence by sentence")
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
