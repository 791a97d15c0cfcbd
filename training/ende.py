"""Prepare the EN->DE translation data from Debian packages, split it, and train its tokenizer.

Three sources, all reachable from a machine with only the Debian archive (see data-sources.md):
- `help`: LibreOffice help pages, aligned exactly by paragraph id (libreoffice-help-en-us + -de),
- `ui`: LibreOffice interface strings, msgid -> msgstr from the German `.mo` catalogs,
- `ding`: natural example sentences from the Ding dictionary (trans-de-en).

    python -m training.ende --out .cache/data/ende --debs .cache/debs

Writes `train.tsv`, `dev.tsv`, `test.tsv` (header `source<TAB>en<TAB>de`, no quoting),
`spm.model`/`spm.vocab` (joint EN+DE, trained on the training split only) and `meta.json`.
Dev and test are drawn from help and ding only, and no English or German side of a held-out pair
appears anywhere in train.
"""

from __future__ import annotations

import argparse
import gettext
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple

from training.provenance import sha256_of
from training.tokenizer import train_sentencepiece

PACKAGES = ("libreoffice-help-en-us", "libreoffice-help-de", "libreoffice-l10n-de", "trans-de-en")
HELP_EN_DIR = "usr/share/libreoffice/help/en-US/text"
HELP_DE_DIR = "usr/share/libreoffice/help/de/text"
UI_MO_DIR = "usr/lib/libreoffice/program/resource/de/LC_MESSAGES"
DING_FILE = "usr/share/trans/de-en"

SOURCES = ("help", "ui", "ding")
SPLITS = ("train", "dev", "test")
DEV_SIZE = 1000
TEST_SIZE = 1500
MIN_HELD_OUT_HELP_WORDS = 4  # shorter help strings are mostly headings and menu paths
MAX_WORDS = 120
MAX_LENGTH_RATIO = 3.0
VOCAB_SIZE = 8000

_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_DING_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]")


class Pair(NamedTuple):
    source: str
    en: str
    de: str


def normalize_space(text: str) -> str:
    return " ".join(text.split())


# --- Debian packages -----------------------------------------------------------------------------


def download_debs(debs_dir: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Return package -> .deb path, downloading with `apt-get download` what is not cached yet."""
    debs_dir.mkdir(parents=True, exist_ok=True)
    missing = [name for name in packages if not list(debs_dir.glob(f"{name}_*.deb"))]
    if missing:
        download = ["apt-get", "download", *missing]
        if subprocess.run(download, cwd=debs_dir).returncode != 0:
            # A fresh machine has empty package lists; one update is enough.
            subprocess.run(["apt-get", "update"], check=True)
            subprocess.run(download, cwd=debs_dir, check=True)
    return {name: sorted(debs_dir.glob(f"{name}_*.deb"))[-1] for name in packages}


def deb_version(deb: Path) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True
    ).stdout.strip()


def unpack_deb(deb: Path, dest: Path) -> Path:
    """`dpkg -x` the package into `dest` (no install); skipped when this exact file was unpacked."""
    marker = dest / ".unpacked-from"
    if marker.exists() and marker.read_text() == deb.name:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg", "-x", str(deb), str(dest)], check=True)
    marker.write_text(deb.name)
    return dest


# --- LibreOffice help ----------------------------------------------------------------------------


class _IdTextParser(HTMLParser):
    """Collect the plain text of every `<p id=...>` and `<h1..h6 id=...>`, first occurrence per id."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # unescapes entities in handle_data
        self.texts: dict[str, str] = {}
        self._tag: str | None = None
        self._id = ""
        self._depth = 0
        self._parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._tag is None:
            element_id = dict(attrs).get("id")
            if (tag == "p" or tag in _HEADINGS) and element_id:
                self._tag, self._id, self._depth, self._parts = tag, element_id, 1, []
        elif tag == self._tag:
            self._depth += 1
        elif tag == "br":
            self._parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag != self._tag:
            return
        self._depth -= 1
        if self._depth == 0:
            self.texts.setdefault(self._id, normalize_space("".join(self._parts)))
            self._tag = None

    def handle_data(self, data: str) -> None:
        if self._tag is not None:
            self._parts.append(data)


def parse_help_html(html: str) -> dict[str, str]:
    """Map paragraph/heading id -> its text with inner tags stripped and entities unescaped."""
    parser = _IdTextParser()
    parser.feed(html)
    parser.close()
    return parser.texts


def align_by_id(en_texts: dict[str, str], de_texts: dict[str, str]) -> list[tuple[str, str]]:
    return [(text, de_texts[element_id]) for element_id, text in en_texts.items() if element_id in de_texts]


def help_pairs(en_root: Path, de_root: Path) -> list[Pair]:
    """Pair equal ids in the same relative HTML file of the English and German help."""
    pairs = []
    for en_file in sorted(en_root.rglob("*.html")):
        de_file = de_root / en_file.relative_to(en_root)
        if not de_file.exists():
            continue
        en_texts = parse_help_html(en_file.read_text(encoding="utf-8"))
        de_texts = parse_help_html(de_file.read_text(encoding="utf-8"))
        pairs.extend(Pair("help", en, de) for en, de in align_by_id(en_texts, de_texts))
    return pairs


# --- LibreOffice UI strings ----------------------------------------------------------------------


def catalog_pairs(catalog: dict) -> list[tuple[str, str]]:
    """msgid -> msgstr pairs of a gettext catalog, without context prefixes or `~` accelerators."""
    pairs = []
    for key, translated in catalog.items():
        if isinstance(key, tuple):  # plural entry: (msgid, n); keep only the singular form
            msgid, form = key
            if form != 0:
                continue
        else:
            msgid = key
        if not msgid:  # the catalog header
            continue
        msgid = msgid.split("\x04", 1)[-1]  # "context\x04msgid"
        pairs.append((normalize_space(msgid.replace("~", "")), normalize_space(translated.replace("~", ""))))
    return pairs


def ui_pairs(mo_dir: Path) -> list[Pair]:
    pairs = []
    for mo_file in sorted(mo_dir.glob("*.mo")):
        with mo_file.open("rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        pairs.extend(Pair("ui", en, de) for en, de in catalog_pairs(catalog))
    return pairs


# --- Ding dictionary -----------------------------------------------------------------------------


def parse_ding_line(line: str) -> list[tuple[str, str]]:
    """(en, de) for each ` | ` sub-entry of a `DE :: EN` line, taking each side's first `;` synonym.

    Only the first synonym is paired because the others are alternatives, not translations of
    each other; `{gender}` and `[domain]` annotations are removed.
    """
    if line.startswith("#") or " :: " not in line:
        return []
    german, english = line.rstrip("\n").split(" :: ", 1)
    de_entries, en_entries = german.split(" | "), english.split(" | ")
    if len(de_entries) != len(en_entries):
        return []
    pairs = []
    for de_entry, en_entry in zip(de_entries, en_entries, strict=True):
        de_first, en_first = _first_synonym(de_entry), _first_synonym(en_entry)
        if de_first and en_first:
            pairs.append((en_first, de_first))
    return pairs


def _first_synonym(entry: str) -> str:
    synonyms = (normalize_space(_DING_ANNOTATION.sub(" ", s)) for s in entry.split(";"))
    return next((s for s in synonyms if s), "")


def is_natural_sentence(text: str) -> bool:
    """A full sentence rather than a word or phrase: capitalised, final punctuation, >= 3 words."""
    return len(text.split()) >= 3 and text[0].isupper() and text[-1] in ".!?"


def ding_sentence_pairs(path: Path) -> list[Pair]:
    with path.open(encoding="utf-8") as f:
        return [
            Pair("ding", en, de)
            for line in f
            for en, de in parse_ding_line(line)
            if is_natural_sentence(en) and is_natural_sentence(de)
        ]


# --- cleaning and splitting ----------------------------------------------------------------------


def keep_pair(pair: Pair) -> bool:
    """Drop empty, untranslated, over-long and badly length-mismatched pairs."""
    en_words, de_words = len(pair.en.split()), len(pair.de.split())
    if not (1 <= en_words <= MAX_WORDS and 1 <= de_words <= MAX_WORDS):
        return False
    if pair.en == pair.de:
        return False
    return 1 / MAX_LENGTH_RATIO <= en_words / de_words <= MAX_LENGTH_RATIO


def clean_pairs(pairs: Iterable[Pair]) -> list[Pair]:
    """Filter with `keep_pair` and keep the first copy of each (en, de), whatever its source."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for pair in pairs:
        key = (pair.en, pair.de)
        if key not in seen and keep_pair(pair):
            seen.add(key)
            kept.append(pair)
    return kept


def can_be_held_out(pair: Pair) -> bool:
    if pair.source == "help":
        return len(pair.en.split()) >= MIN_HELD_OUT_HELP_WORDS
    return pair.source == "ding"


def split_pairs(
    pairs: list[Pair], seed: int, dev_size: int = DEV_SIZE, test_size: int = TEST_SIZE
) -> dict[str, list[Pair]]:
    """Draw dev and test (about half help, half ding) with `seed`; train gets the rest minus leaks.

    A held-out pair's English (and German) text, compared case-insensitively, appears in no other
    held-out pair and in no training pair.
    """
    rng = random.Random(seed)
    candidates = {
        source: [p for p in pairs if p.source == source and can_be_held_out(p)] for source in ("help", "ding")
    }
    for source_pairs in candidates.values():
        rng.shuffle(source_pairs)
    draw = {source: iter(source_pairs) for source, source_pairs in candidates.items()}

    held_texts: set[str] = set()
    held: dict[str, list[Pair]] = {}
    for split, size in (("test", test_size), ("dev", dev_size)):
        held[split] = []
        for source, count in (("help", size // 2), ("ding", size - size // 2)):
            for pair in _take_unseen(draw[source], count, held_texts):
                held[split].append(pair)
                held_texts.update(_leak_keys(pair))
    train = [p for p in pairs if not (_leak_keys(p) & held_texts)]
    return {"train": train, "dev": held["dev"], "test": held["test"]}


def _leak_keys(pair: Pair) -> set[str]:
    return {"en:" + pair.en.casefold(), "de:" + pair.de.casefold()}


def _take_unseen(pairs: Iterator[Pair], count: int, held_texts: set[str]) -> list[Pair]:
    taken: list[Pair] = []
    seen = set(held_texts)
    for pair in pairs:
        if len(taken) == count:
            break
        keys = _leak_keys(pair)
        if keys & seen:
            continue
        taken.append(pair)
        seen |= keys
    if len(taken) < count:
        raise ValueError(f"not enough held-out candidates: wanted {count}, found {len(taken)}")
    return taken


# --- writing -------------------------------------------------------------------------------------


def write_tsv(path: Path, pairs: list[Pair]) -> None:
    # Every text went through normalize_space, so it holds no tab or newline and needs no quoting.
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("source\ten\tde\n")
        for pair in pairs:
            f.write(f"{pair.source}\t{pair.en}\t{pair.de}\n")


def _is_prepared(out_dir: Path, seed: int, versions: dict[str, str], vocab_size: int) -> dict | None:
    """Return the existing meta if it was made the same way and every file is unchanged."""
    meta_path = out_dir / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    made_with = (meta.get("seed"), meta.get("package_versions"), meta.get("tokenizer", {}).get("vocab_size"))
    if made_with != (seed, versions, vocab_size):
        return None
    for name, digest in meta.get("sha256", {}).items():
        if not (out_dir / name).exists() or sha256_of(out_dir / name) != digest:
            return None
    return meta


def prepare_ende(
    out_dir: Path, seed: int = 1234, debs_dir: Path = Path(".cache/debs"), vocab_size: int = VOCAB_SIZE
) -> dict:
    """Download and unpack the packages, extract, clean and split the pairs, train the tokenizer."""
    debs = download_debs(debs_dir)
    versions = {name: deb_version(deb) for name, deb in debs.items()}
    existing = _is_prepared(out_dir, seed, versions, vocab_size)
    if existing is not None:
        return existing

    roots = {name: unpack_deb(deb, debs_dir / "unpacked" / name) for name, deb in debs.items()}
    raw = {
        "help": help_pairs(
            roots["libreoffice-help-en-us"] / HELP_EN_DIR, roots["libreoffice-help-de"] / HELP_DE_DIR
        ),
        "ui": ui_pairs(roots["libreoffice-l10n-de"] / UI_MO_DIR),
        "ding": ding_sentence_pairs(roots["trans-de-en"] / DING_FILE),
    }
    cleaned = clean_pairs(pair for source in SOURCES for pair in raw[source])
    splits = split_pairs(cleaned, seed)

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_tsv(out_dir / f"{split}.tsv", splits[split])

    started = time.perf_counter()
    model_path = train_sentencepiece(
        (text for pair in splits["train"] for text in (pair.en, pair.de)),
        out_dir / "spm",
        vocab_size,
        character_coverage=0.9999,
        seed=seed,
    )
    tokenizer_seconds = time.perf_counter() - started

    files = [f"{split}.tsv" for split in SPLITS] + [model_path.name]
    meta = {
        "dataset": "ende",
        "package_versions": versions,
        "seed": seed,
        "columns": ["source", "en", "de"],
        "extracted_pairs": {source: len(raw[source]) for source in SOURCES},
        "cleaned_pairs": _source_counts(cleaned),
        "removed_from_train_as_leaks": len(cleaned) - sum(len(splits[split]) for split in SPLITS),
        "counts": {split: _source_counts(splits[split]) for split in SPLITS},
        "tokenizer": {
            "model": model_path.name,
            "vocab_size": vocab_size,
            "trained_on": "train.tsv en + de",
            "train_seconds": round(tokenizer_seconds, 1),
        },
        "sha256": {name: sha256_of(out_dir / name) for name in files},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _source_counts(pairs: list[Pair]) -> dict[str, int]:
    counts = Counter(pair.source for pair in pairs)
    return {"total": len(pairs), **{source: counts[source] for source in SOURCES}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/ende"))
    parser.add_argument("--debs", type=Path, default=Path(".cache/debs"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    meta = prepare_ende(args.out, args.seed, args.debs, args.vocab_size)
    json.dump({"counts": meta["counts"], "sha256": meta["sha256"]}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
