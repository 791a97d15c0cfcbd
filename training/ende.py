"""Prepare the EN->DE translation data from Debian packages, split it, and train its tokenizer.

Five sources, all reachable from a machine with only the Debian archive (see data-sources.md):
- `help`: LibreOffice help pages, aligned exactly by paragraph id (libreoffice-help-en-us + -de),
- `ui`: LibreOffice interface strings, msgid -> msgstr from the German `.mo` catalogs,
- `ding`: natural example sentences from the Ding dictionary (trans-de-en),
- `desc`: Debian package descriptions (DDTP), apt's `Translation-de` paired with `Translation-en` by
  Description-md5: short descriptions directly, long ones paragraph by paragraph where the counts match,
- `gettext`: the German `.mo` catalogs (`usr/share/locale/de/LC_MESSAGES`) of GETTEXT_PACKAGES, common
  programs' interface strings. No documentation or help package other than LibreOffice's is read.
Train also gets `joined` examples: consecutive help/desc training pairs joined into 100-250-token ones.

    python -m training.ende --out .cache/data/ende --debs .cache/debs

Writes `train.tsv`, `dev.tsv`, `test.tsv` (header `source<TAB>en<TAB>de`, no quoting),
`spm.model`/`spm.vocab` (joint EN+DE, trained on the training split only) and `meta.json`.
Dev and test are drawn from help and ding (the same pairs as before desc and gettext were added, so dev
perplexities compare across data versions); test also holds `desc` pairs from whole source packages held
out of training. No English or German side of a held-out pair appears anywhere in train.
"""

from __future__ import annotations

import argparse
import gettext
import json
import random
import re
import shutil
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
GETTEXT_MO_DIR = "usr/share/locale/de/LC_MESSAGES"
# Common programs: GNU tools, Debian's package tools, GNOME/Xfce applications and libraries, office and media
# programs. Interface strings only (LC_MESSAGES). Five of them (abiword-common, cups-common, gimp, parted,
# transmission-common) turned out to keep their German catalog in another package and add nothing; they stay
# listed so the prepared data (whose meta.json records every package version) is the one models trained on.
GETTEXT_PACKAGES = (
    "abiword-common", "apt", "aptitude-common", "audacity-data", "baobab", "binutils-common", "bison",
    "brasero-common", "cheese-common", "claws-mail-i18n", "coreutils", "cups-common", "diffutils", "dpkg",
    "e2fsprogs-l10n", "eog", "evince-common", "evolution-common", "file-roller", "filezilla-common", "findutils",
    "gawk", "gcc-12-locales", "geany-common", "gedit-common", "gettext", "gimp", "git", "gnome-calculator",
    "gnome-control-center-data", "gnome-disk-utility", "gnome-shell-common", "gnome-software-common",
    "gnome-terminal-data", "gnucash-common", "gnumeric-common", "gnupg-l10n", "gparted-common", "grep",
    "hexchat-common", "libc-l10n", "libglib2.0-data", "libgtk-3-common", "libgtk2.0-common", "libsane-common",
    "make", "mc-data", "mousepad", "nano", "nautilus-data", "network-manager-gnome", "parted", "pidgin-data",
    "procps", "psmisc", "rhythmbox-data", "sed", "seahorse", "shotwell-common", "simple-scan", "synaptic",
    "system-config-printer-common", "tar", "thunar-data", "totem-common", "transmission-common",
    "util-linux-locales", "vlc-l10n", "wget", "xfce4-panel", "xfce4-settings",
)  # fmt: skip
# apt's DDTP index files (bookworm main), fetched by `apt-get -o Acquire::Languages=de,en update`.
APT_LISTS = Path("/var/lib/apt/lists")
DDTP_FILES = {
    "translation_de": "deb.debian.org_debian_dists_bookworm_main_i18n_Translation-de.lz4",
    "translation_en": "deb.debian.org_debian_dists_bookworm_main_i18n_Translation-en.lz4",
    "packages": "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages.lz4",
    "release": "deb.debian.org_debian_dists_bookworm_InRelease",
}

SOURCES = ("help", "ui", "ding", "desc", "gettext")
JOINED_SOURCES = ("help", "desc")  # in document order in train, so consecutive pairs continue each other
JOINED_WORDS = (60, 150)  # English words per joined example, drawn per example: 100-250 tokens
JOINED_COUNT = 4000
SPLITS = ("train", "dev", "test")
DEV_SIZE = 1000
TEST_SIZE = 1500
DESC_TEST_SIZE = 750
MIN_HELD_OUT_DESC_WORDS = 4
MIN_HELD_OUT_HELP_WORDS = 4  # shorter help strings are mostly headings and menu paths
MAX_WORDS = 120
MAX_LENGTH_RATIO = 3.0
VOCAB_SIZE = 8000

_HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
_DING_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GTK_MNEMONIC = re.compile(r"_(?=\w)")
_LIST_ITEM = re.compile(r"^\s*[-*+o] ")


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


def ui_pairs(mo_dir: Path, source: str = "ui") -> list[Pair]:
    pairs = []
    for mo_file in sorted(mo_dir.glob("*.mo")):
        with mo_file.open("rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        pairs.extend(Pair(source, en, de) for en, de in catalog_pairs(catalog))
    return pairs


def without_gtk_mnemonic(text: str) -> str:
    """GTK marks the accelerator key with one `_` ("_Open", "Ö_ffnen"); a text with more is left alone
    (identifiers such as `file_name`)."""
    return _GTK_MNEMONIC.sub("", text) if text.count("_") == 1 else text


def gettext_pairs(roots: Iterable[Path]) -> list[Pair]:
    """Interface strings of the German catalogs of unpacked packages, mnemonics removed."""
    pairs = []
    for root in roots:
        for pair in ui_pairs(root / GETTEXT_MO_DIR, "gettext"):
            pairs.append(Pair("gettext", without_gtk_mnemonic(pair.en), without_gtk_mnemonic(pair.de)))
    return pairs


# --- Debian package descriptions (DDTP) ----------------------------------------------------------


class Description(NamedTuple):
    package: str
    short: str
    paragraphs: list[str]  # long description; each paragraph's lines joined, list items kept as lines


def parse_translation_file(text: str, language: str) -> dict[str, Description]:
    """Description-md5 -> the record's description in `language`, from an apt Translation-xx file.

    Continuation lines start with a space; a line " ." separates paragraphs. List-item lines keep a
    leading newline so that `list_items` can split them later."""
    descriptions: dict[str, Description] = {}
    field = f"Description-{language}:"
    for record in text.split("\n\n"):
        package, md5, lines = "", "", []
        collecting = False
        for line in record.splitlines():
            if line.startswith("Package:"):
                package, collecting = line.split(":", 1)[1].strip(), False
            elif line.startswith("Description-md5:"):
                md5, collecting = line.split(":", 1)[1].strip(), False
            elif line.startswith(field):
                lines, collecting = [line[len(field) :].strip()], True
            elif collecting and line.startswith(" "):
                lines.append(line[1:])
            else:
                collecting = False
        if md5 and lines:
            descriptions.setdefault(md5, Description(package, normalize_space(lines[0]), _paragraphs(lines[1:])))
    return descriptions


def _paragraphs(lines: list[str]) -> list[str]:
    paragraphs, current = [], []
    for line in lines + ["."]:
        if line.strip() == ".":
            if current:
                paragraphs.append("\n".join(current))
            current = []
        else:
            current.append(line.rstrip())
    return paragraphs


def list_items(paragraph: str) -> list[str]:
    """A paragraph split before each list-item line ("* foo", "- foo"); continuation lines stay with
    their item. A paragraph without items is one element."""
    items: list[str] = []
    for line in paragraph.split("\n"):
        if _LIST_ITEM.match(line) or not items:
            items.append(line)
        else:
            items[-1] += " " + line
    return [normalize_space(_LIST_ITEM.sub("", item)) for item in items]


def description_pairs(german: dict[str, Description], english: dict[str, Description]) -> list[tuple[str, Pair]]:
    """(package, pair) for each description with both languages: the short descriptions, and the long
    ones paragraph by paragraph (and list item by list item) only where the counts match."""
    pairs = []
    for md5, de in german.items():
        en = english.get(md5)
        if en is None:
            continue
        pairs.append((de.package, Pair("desc", en.short, de.short)))
        if len(en.paragraphs) != len(de.paragraphs):
            continue
        for en_paragraph, de_paragraph in zip(en.paragraphs, de.paragraphs, strict=True):
            en_items, de_items = list_items(en_paragraph), list_items(de_paragraph)
            if len(en_items) != len(de_items):
                en_items, de_items = [normalize_space(en_paragraph)], [normalize_space(de_paragraph)]
            pairs.extend((de.package, Pair("desc", e, d)) for e, d in zip(en_items, de_items, strict=True))
    return pairs


def source_packages(packages_index: str) -> dict[str, str]:
    """Binary package -> its source package, from an apt Packages file (Source defaults to the name)."""
    sources = {}
    for record in packages_index.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in record.splitlines() if ": " in line and line[0] != " ")
        if "Package" in fields:
            sources[fields["Package"]] = fields.get("Source", fields["Package"]).split()[0]
    return sources


def copy_ddtp_files(ddtp_dir: Path, lists: Path = APT_LISTS) -> dict[str, Path]:
    """Copy apt's index files into the cache once, so a later `apt-get update` does not change the data."""
    ddtp_dir.mkdir(parents=True, exist_ok=True)
    if not all((lists / name).exists() for name in DDTP_FILES.values()) and not all(
        (ddtp_dir / name).exists() for name in DDTP_FILES.values()
    ):
        subprocess.run(["apt-get", "-o", "Acquire::Languages=de,en", "update"], check=True)
    for name in DDTP_FILES.values():
        if not (ddtp_dir / name).exists():
            shutil.copyfile(lists / name, ddtp_dir / name)
    return {key: ddtp_dir / name for key, name in DDTP_FILES.items()}


def read_lz4(path: Path) -> str:
    return subprocess.run(["lz4", "-dc", str(path)], check=True, capture_output=True).stdout.decode("utf-8")


def release_date(in_release: Path) -> str:
    for line in in_release.read_text(encoding="utf-8").splitlines():
        if line.startswith("Date:"):
            return line.split(":", 1)[1].strip()
    return ""


def ddtp_pairs(files: dict[str, Path]) -> tuple[list[Pair], dict[tuple[str, str], set[str]]]:
    """Package-description pairs and, per (en, de), the source packages whose descriptions hold it."""
    german = parse_translation_file(read_lz4(files["translation_de"]), "de")
    english = parse_translation_file(read_lz4(files["translation_en"]), "en")
    to_source = source_packages(read_lz4(files["packages"]))
    pairs, owners = [], {}
    for package, pair in description_pairs(german, english):
        pairs.append(pair)
        owners.setdefault((pair.en, pair.de), set()).add(to_source.get(package, package))
    return pairs, owners


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
    pairs: list[Pair],
    seed: int,
    dev_size: int = DEV_SIZE,
    test_size: int = TEST_SIZE,
    desc_owners: dict[tuple[str, str], set[str]] | None = None,
    desc_test_size: int = DESC_TEST_SIZE,
) -> dict[str, list[Pair]]:
    """Draw dev and test (about half help, half ding) with `seed`; train gets the rest minus leaks.

    With `desc_owners` ((en, de) -> source packages of a desc pair), test also gets `desc_test_size`
    package-description pairs from whole source packages drawn with `seed`: every desc pair of a drawn
    package stays out of train, and a test pair must belong to drawn packages only (no boilerplate
    shared with a training package). A held-out pair's English (and German) text, compared
    case-insensitively, appears in no other held-out pair and in no training pair.
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
    held_packages: set[str] = set()
    if desc_owners is not None:
        desc_test, held_packages = _held_out_descriptions(pairs, desc_owners, desc_test_size, held_texts, seed)
        held["test"] += desc_test
        for pair in desc_test:
            held_texts.update(_leak_keys(pair))

    def is_held_out_package(pair: Pair) -> bool:
        return pair.source == "desc" and bool(desc_owners[(pair.en, pair.de)] & held_packages)

    train = [p for p in pairs if not (_leak_keys(p) & held_texts) and not is_held_out_package(p)]
    return {"train": train, "dev": held["dev"], "test": held["test"]}


def _held_out_descriptions(
    pairs: list[Pair], owners: dict[tuple[str, str], set[str]], size: int, held_texts: set[str], seed: int
) -> tuple[list[Pair], set[str]]:
    """Draw whole source packages (seeded) until their own desc pairs fill `size` test pairs."""
    by_package: dict[str, list[Pair]] = {}
    for pair in pairs:
        if pair.source == "desc" and len(pair.en.split()) >= MIN_HELD_OUT_DESC_WORDS:
            package_set = owners[(pair.en, pair.de)]
            if len(package_set) == 1:  # text of one source package only
                by_package.setdefault(next(iter(package_set)), []).append(pair)
    packages = sorted(by_package)
    random.Random(seed).shuffle(packages)
    taken: list[Pair] = []
    drawn: set[str] = set()
    # No other source's text either: a model trained on the other sources alone has not seen a test pair.
    seen = held_texts | {key for pair in pairs if pair.source != "desc" for key in _leak_keys(pair)}
    for package in packages:
        if len(taken) >= size:
            break
        drawn.add(package)
        for pair in by_package[package]:
            keys = _leak_keys(pair)
            if len(taken) < size and not keys & seen:
                taken.append(pair)
                seen |= keys
    if len(taken) < size:
        raise ValueError(f"not enough held-out descriptions: wanted {size}, found {len(taken)}")
    return taken, drawn


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


# --- long training examples ----------------------------------------------------------------------


def joined_training_pairs(train: list[Pair], seed: int, count: int = JOINED_COUNT) -> list[Pair]:
    """Up to `count` long examples: runs of consecutive training pairs of one document-ordered source (help
    paragraphs of a page, description paragraphs) joined on both sides, each run until its English has a
    seeded target of JOINED_WORDS words. Nearly every extracted pair is one sentence or paragraph, and a
    model that never saw a long source stops or loops on one (the length check of the per-domain evaluation).
    The originals stay in train too; no held-out text is involved."""
    rng = random.Random(seed)
    joined: list[Pair] = []
    for source in JOINED_SOURCES:
        pairs = [pair for pair in train if pair.source == source]
        run: list[Pair] = []
        target = rng.randint(*JOINED_WORDS)
        for pair in pairs:
            run.append(pair)
            words = sum(len(p.en.split()) for p in run)
            if words >= target:
                if len(run) > 1 and words <= JOINED_WORDS[1] + 30:  # a long last paragraph would pass n_max
                    joined.append(Pair("joined", " ".join(p.en for p in run), " ".join(p.de for p in run)))
                run, target = [], rng.randint(*JOINED_WORDS)
    rng.shuffle(joined)
    return joined[:count]


# --- writing -------------------------------------------------------------------------------------


def write_tsv(path: Path, pairs: list[Pair]) -> None:
    # Every text went through normalize_space, so it holds no tab or newline and needs no quoting.
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("source\ten\tde\n")
        for pair in pairs:
            f.write(f"{pair.source}\t{pair.en}\t{pair.de}\n")


def _is_prepared(
    out_dir: Path, seed: int, versions: dict[str, str], vocab_size: int, ddtp: dict, reused: dict
) -> dict | None:
    """Return the existing meta if it was made the same way and every file is unchanged."""
    meta_path = out_dir / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    tokenizer = meta.get("tokenizer", {})
    made_with = (meta.get("seed"), meta.get("package_versions"), tokenizer.get("vocab_size"), meta.get("ddtp"))
    if made_with != (seed, versions, vocab_size, ddtp) or tokenizer.get("reused") != reused.get("reused"):
        return None
    for name, digest in meta.get("sha256", {}).items():
        if not (out_dir / name).exists() or sha256_of(out_dir / name) != digest:
            return None
    return meta


def prepare_ende(
    out_dir: Path,
    seed: int = 1234,
    debs_dir: Path = Path(".cache/debs"),
    vocab_size: int = VOCAB_SIZE,
    tokenizer: Path | None = None,
) -> dict:
    """Download and unpack the packages, extract, clean and split the pairs, train the tokenizer.

    With `tokenizer`, that SentencePiece model is copied instead of training one, so that a model trained
    with it (a served bundle's tokenizer.model) can go on training on the new data."""
    debs = download_debs(debs_dir, PACKAGES + GETTEXT_PACKAGES)
    versions = {name: deb_version(deb) for name, deb in debs.items()}
    ddtp = copy_ddtp_files(debs_dir / "ddtp")
    ddtp_provenance = {
        "release_date": release_date(ddtp["release"]),
        "sha256": {DDTP_FILES[key]: sha256_of(path) for key, path in ddtp.items() if key != "release"},
    }
    reused = {"reused": sha256_of(tokenizer)} if tokenizer else {}
    existing = _is_prepared(out_dir, seed, versions, vocab_size, ddtp_provenance, reused)
    if existing is not None:
        return existing

    roots = {name: unpack_deb(deb, debs_dir / "unpacked" / name) for name, deb in debs.items()}
    desc, desc_owners = ddtp_pairs(ddtp)
    raw = {
        "help": help_pairs(roots["libreoffice-help-en-us"] / HELP_EN_DIR, roots["libreoffice-help-de"] / HELP_DE_DIR),
        "ui": ui_pairs(roots["libreoffice-l10n-de"] / UI_MO_DIR),
        "ding": ding_sentence_pairs(roots["trans-de-en"] / DING_FILE),
        "desc": desc,
        "gettext": gettext_pairs(roots[name] for name in GETTEXT_PACKAGES),
    }
    # help, ui and ding come first, so their cleaned pairs (and dev/test drawn from them) are the same
    # as before desc and gettext were added.
    cleaned = clean_pairs(pair for source in SOURCES for pair in raw[source])
    splits = split_pairs(cleaned, seed, desc_owners=desc_owners)
    removed = len(cleaned) - sum(len(splits[split]) for split in SPLITS)
    splits["train"] += joined_training_pairs(splits["train"], seed)

    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_tsv(out_dir / f"{split}.tsv", splits[split])

    started = time.perf_counter()
    if tokenizer:
        model_path = out_dir / "spm.model"
        shutil.copyfile(tokenizer, model_path)
    else:
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
        "ddtp": ddtp_provenance,
        "seed": seed,
        "columns": ["source", "en", "de"],
        "extracted_pairs": {source: len(raw[source]) for source in SOURCES},
        "cleaned_pairs": _source_counts(cleaned),
        "removed_from_train_as_leaks_or_held_out_packages": removed,
        "counts": {split: _source_counts(splits[split]) for split in SPLITS},
        "tokenizer": {
            "model": model_path.name,
            "vocab_size": vocab_size,
            "trained_on": f"copied from {tokenizer}" if tokenizer else "train.tsv en + de",
            "train_seconds": round(tokenizer_seconds, 1),
            **reused,
        },
        "sha256": {name: sha256_of(out_dir / name) for name in files},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _source_counts(pairs: list[Pair]) -> dict[str, int]:
    counts = Counter(pair.source for pair in pairs)
    return {"total": len(pairs), **{source: counts[source] for source in (*SOURCES, "joined") if counts[source]}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/ende"))
    parser.add_argument("--debs", type=Path, default=Path(".cache/debs"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--tokenizer", type=Path, help="reuse this SentencePiece model instead of training one")
    args = parser.parse_args(argv)
    meta = prepare_ende(args.out, args.seed, args.debs, args.vocab_size, args.tokenizer)
    json.dump({"counts": meta["counts"], "sha256": meta["sha256"]}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
