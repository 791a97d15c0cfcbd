"""Held-out texts cut to an exact token count of the served tokenizer, for the load tests.

A text "of length n" is what the model sees as n tokens: SentencePiece pieces plus the BOS/EOS the
bundle adds (config.json `add_bos`/`add_eos`). It is built by joining held-out texts (IMDB test
reviews, EN-DE test sources) and cutting the joined string where it encodes to exactly n - specials
pieces. Cutting the string, not decoding cut ids, keeps the text real (no " ⁇ " for unknown pieces).

Preparation is lazy and cached: nothing happens at import (locust imports every module of this
folder), the first request for a length builds its texts once per process, and
`python -m loadtest.texts` writes them to loadtest/.cache/ (or $LOADTEST_CACHE) so that a load generator without
sentencepiece or the data (the locust container mounts only loadtest/) can read them.
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


def _cache_file(corpus: Corpus) -> Path:
    digest = hashlib.sha256(corpus.tokenizer.read_bytes()).hexdigest()[:12] if corpus.tokenizer.exists() else "none"
    return CACHE / f"texts-{corpus.task}-{digest}-{corpus.n_special}.json"


def _prepared(task: str) -> Path | None:
    """A prepared file for this task: the one for the current tokenizer, else any (the container)."""
    corpus = corpus_for(task)
    exact = _cache_file(corpus)
    if exact.exists():
        return exact
    if corpus.tokenizer.exists() and corpus.data.exists():
        return None  # build from the sources rather than trust a file made with another tokenizer
    found = sorted(CACHE.glob(f"texts-{task}-*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


@cache
def texts_of_length(task: str, n: int) -> tuple[str, ...]:
    """Texts of n tokens for `task`, from the prepared file when it has them, else built (and kept)."""
    prepared = _prepared(task)
    if prepared is not None:
        stored = json.loads(prepared.read_text())
        if str(n) in stored["texts"]:
            return tuple(stored["texts"][str(n)])
    corpus = corpus_for(task)
    if not (corpus.tokenizer.exists() and corpus.data.exists()):
        raise FileNotFoundError(
            f"no prepared {task} texts of length {n} in {CACHE} and no tokenizer/data to build them "
            f"({corpus.tokenizer}, {corpus.data}); run `python -m loadtest.texts` where they exist"
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.texts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("classify", "translate", "all"), default="all")
    parser.add_argument("--lengths", help="comma-separated; default: the locustfiles' lengths")
    parser.add_argument("--variants", type=int, default=4, help="different texts per length")
    args = parser.parse_args(argv)
    for task, default in (("classify", CLASSIFY_LENGTHS), ("translate", TRANSLATE_LENGTHS)):
        if args.task not in (task, "all"):
            continue
        corpus = corpus_for(task)
        if not (corpus.tokenizer.exists() and corpus.data.exists()):
            print(f"{task}: skipped, missing {corpus.tokenizer} or {corpus.data}")
            continue
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(default)
        path = prepare(task, lengths, args.variants)
        counts = {n: sorted({token_count(corpus, t) for t in texts_of_length.__wrapped__(task, n)}) for n in lengths}
        print(f"{task}: {path} (tokenizer {corpus.tokenizer}); token counts per length: {counts}")


if __name__ == "__main__":
    main()
