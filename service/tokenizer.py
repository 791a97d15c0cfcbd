"""Text -> token ids exactly as the bundle was trained: SentencePiece, then BOS/EOS per config.json; target ids ->
text, carrying the source's unknown pieces, web addresses and e-mail addresses over; text written all in capitals
read in sentence case; and the sentence splitting /translate does before it encodes."""

import itertools
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from service.bundle import Bundle


class TextTooLong(ValueError):
    def __init__(self, index: int, n_tokens: int, n_max: int, what: str = "text {index}"):
        self.index, self.n_tokens, self.n_max = index, n_tokens, n_max
        super().__init__(
            f"{what.format(index=index)} is {n_tokens} tokens, over this model's limit of n_max={n_max} tokens; "
            'shorten it or send "truncate": true to cut it to the limit'
        )


class TooManySentences(ValueError):
    """/translate's texts hold more sentences than `limit`, the most its decode budget can pay for."""

    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"more than {limit} sentences")


# Between two sentences: a line break (with the blank lines and indentation around it), or the spaces after a
# sentence's end (. ! ? …, then closing quotes or brackets) when a capital, a digit or an opening quote follows. A
# line break's leading spaces are matched from where their run starts only: tried at every space, a long run with no
# line break was scanned to its end from each of them (40 KB of spaces: 3 s of the event loop).
_BOUNDARY = re.compile(
    r"""(?P<line>(?<![ \t\r])[ \t\r]*\n\s*)"""
    r"""|[.!?…]["'”’)\]]*(?P<space>[ \t]+)(?=["'“‘(\[]?[A-Z0-9ÄÖÜ])"""
)
# a period after these ends a word, not a sentence (lower-cased, without the period)
_ABBREVIATIONS = frozenset("e.g i.e etc vs cf approx fig no nos vol dr mr mrs ms prof st jr sr inc ltd co".split())
# the characters before a period that can tell: a word longer than any abbreviation is none, whatever its end.
# (Looking at everything since the last sentence's start instead, a text of initials, "A. A. A. ...", sliced an ever
# longer run at each period: 16 s of the event loop for 900 KB.)
_WORD_WINDOW = max(map(len, _ABBREVIATIONS)) + 2


def split_sentences(text: str, at_most: int | None = None) -> list[tuple[str, str]]:
    """A text as [(sentence, the whitespace after it)], in order: ''.join(s + w) is the text without its leading
    and trailing whitespace. Rule-based: sentences end at line breaks, and at . ! ? … before a capital or digit,
    except a period after a known abbreviation or a single letter (an initial). With `at_most`, the split stops at
    its first at_most + 1 sentences (the last then holds the rest): enough to tell that there are too many."""
    text = text.strip()
    parts, start = [], 0
    for match in _BOUNDARY.finditer(text):
        if at_most is not None and len(parts) == at_most:
            break
        gap = "line" if match.group("line") is not None else "space"
        if gap == "space" and text[match.start()] == ".":
            words = text[max(start, match.start() - _WORD_WINDOW) : match.start()].rsplit(None, 1)
            word = words[-1].lower() if words else ""
            if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                continue
        parts.append((text[start : match.start(gap)], match.group(gap)))
        start = match.end(gap)
    parts.append((text[start:], ""))
    return parts


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool
    unknowns: tuple[str, ...] = ()  # the text of each unknown piece (emoji, other scripts), in order: see decode


# {1}, {2}, ... stand in a translation's source for what the vocabulary cannot spell: the translators copy such a
# placeholder into their output (179 of 200 help sentences with an emoji, benchmarks/translate_paragraphs.py), where
# they drop the unknown piece or write something else for it (46 of 200 came back that way)
# (a text's own {n} count up to nine digits: ours come after them, and a longer one cannot be mistaken for ours;
# unbounded, "{" + 5,000 nines + "}" was an integer Python refuses to convert, a 500)
_PLACEHOLDER = re.compile(r"\{(\d{1,9})\}")
# what a translator writes of a placeholder when a sentence has many (ten symbols between words: "🙂}}", "{4eat}",
# "Grate8}"): a brace with the digits beside it. Where the source had no brace of its own, every brace in the
# translation that is not a whole placeholder of ours is such debris, and is dropped.
_PLACEHOLDER_DEBRIS = re.compile(r"\{?\d*\}|\{\d*")
# ... and for what must come back exactly as written though the vocabulary can spell it: web and e-mail addresses,
# which the translators otherwise break up or translate (0-2 of 200 help sentences kept an inserted one). A web
# address runs from its scheme (or "www.") to the next space, quote or angle bracket, less closing punctuation. A
# scheme and an e-mail address's local part start where a run of the characters they are made of starts, and are
# bounded (as RFC 3986 and 5321 allow): with \b and no bound, every word boundary of 40 KB of "a.a.a..." began a scan
# to the text's end, 14 s of the event loop.
_VERBATIM = re.compile(
    r"""(?:(?<![a-z0-9+.-])[a-z][a-z0-9+.-]{0,31}://|\bwww\.)[^\s<>"'`]+(?<![.,;:!?)\]}'"’”])"""
    r"|(?<![\w.+-])[\w.+-]{1,64}@[\w-]{1,63}(?:\.[\w-]{1,63})+",
    re.IGNORECASE,
)


def _without_debris(translation: str, placeholders: Container[str]) -> str:
    """A translation without the placeholder debris in it: every brace, with its digits, that is not one of
    `placeholders` whole (for a source without braces of its own), and the double space a removal leaves."""
    dropped = []

    def keep_ours(debris: re.Match) -> str:
        if debris[0] in placeholders:
            return debris[0]
        dropped.append(debris[0])
        return ""

    kept = _PLACEHOLDER_DEBRIS.sub(keep_ours, translation)
    return re.sub(" {2,}", " ", kept).strip(" ") if dropped else kept


def _first_placeholder(text: str) -> int:
    """The number a text's first placeholder gets: after any {n} it has of its own."""
    return max((int(n) for n in _PLACEHOLDER.findall(text)), default=0) + 1


def _protect_verbatim(text: str) -> tuple[str, tuple[str, ...], int]:
    """The text with each web or e-mail address replaced by {n}, those addresses, and the first n."""
    if "@" not in text and "://" not in text and "www." not in text.lower():  # (most texts: no regex scan)
        return text, (), 0
    spans = tuple(_VERBATIM.findall(text))
    if not spans:
        return text, (), 0
    first = _first_placeholder(text)
    numbers = itertools.count(first)
    return _VERBATIM.sub(lambda _: f"{{{next(numbers)}}}", text), spans, first


# Text written all in capitals is read in sentence case: the models learnt from ordinarily cased text, and read
# capitals as noise. 300 help sentences in capitals: BLEU 1.1 read as written, 27.8 in sentence case (29.7 as
# written in ordinary case); 500 test reviews in capitals: 49 % accuracy, a coin toss, against 80.4 % (82 %);
# benchmarks/results/shouted.md, the Linformer bundles.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
# a sentence's first letter: the text's, or the first after . ! ? … (with closing quotes or brackets) and whitespace
_SENTENCE_START = re.compile(r"""(?:^\s*|[.!?…]["'”’)\]]*\s+)["'“‘(\[]*[^\W\d_]""")


def in_sentence_case(text: str) -> str | None:
    """A text with no lower-case letter (and some upper-case one) in sentence case: lowered, then each sentence's
    first letter raised; None for any other text, which is read as written. Its lower case leads back to it by
    str.upper() (where some letter's would not, İ or ẞ, only its ASCII letters are lowered), so what /translate
    carries over from it unread (what the vocabulary cannot spell) comes back as written."""
    if not text.isupper():
        return None
    lowered = text.lower()
    if lowered.upper() != text:
        lowered = text.translate(_ASCII_LOWER)
    return _SENTENCE_START.sub(lambda start: start[0][:-1] + start[0][-1].upper(), lowered)


@dataclass(frozen=True)
class Source:
    """One row of a translation request: a sentence of text `text` (or the whole text), encoded with placeholders
    {first}, {first + 1}, ... for `spans`, the whitespace before it (a text's leading whitespace, on its first row)
    and the whitespace that follows it in the text."""

    text: int
    encoded: Encoded
    spans: tuple[str, ...]
    first: int
    gap: str
    lead: str = ""
    braces: bool = False  # the sentence has a brace of its own (so a brace in its translation may be one)
    shouted: bool = False  # written all in capitals, encoded in sentence case: translated, it comes back in capitals


class Tokenizer:
    def __init__(
        self, model_file: Path, *, bos_id: int, eos_id: int, add_bos: bool, add_eos: bool, n_max: int
    ):
        self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.unk_id = self._sp.unk_id()
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.n_max = n_max

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "Tokenizer":
        return cls(
            bundle.tokenizer_path,
            bos_id=bundle.bos_id,
            eos_id=bundle.eos_id,
            add_bos=bundle.add_bos,
            add_eos=bundle.add_eos,
            n_max=bundle.n_max,
        )

    def encode_all(self, texts: list[str], *, truncate: bool, unknowns: bool = True) -> list[Encoded]:
        """Raises TextTooLong for the first text over n_max unless truncate, which cuts the body. `unknowns`: also
        the text behind each unknown piece (a second encode, what /translate carries over; /classify needs none)."""
        n_special = int(self.add_bos) + int(self.add_eos)
        encoded = []
        # one call per text: a list call starts SentencePiece's thread pool, ~40x slower for one short text
        for index, body in enumerate(map(self._sp.encode, texts)):
            truncated = len(body) + n_special > self.n_max
            if truncated:
                if not truncate:
                    raise TextTooLong(index, len(body) + n_special, self.n_max)
                body = body[: self.n_max - n_special]
            ids = [self.bos_id] * self.add_bos + body + [self.eos_id] * self.add_eos
            behind = self._unknowns(texts[index], len(body)) if unknowns and self.unk_id in body else ()
            encoded.append(Encoded(ids, truncated, behind))
        return encoded

    def encode_to_classify(self, texts: list[str], *, truncate: bool) -> list[Encoded]:
        """What /classify encodes: each text as written, or in sentence case if written all in capitals."""
        return self.encode_all([in_sentence_case(text) or text for text in texts], truncate=truncate, unknowns=False)

    def _unknowns(self, text: str, n_pieces: int) -> tuple[str, ...]:
        """The source text behind each unknown piece among the first `n_pieces` (a second, rarer encode)."""
        pieces = self._sp.encode(text, return_type="proto").pieces[:n_pieces]
        # surface: the original characters; empty where normalisation made the piece (NFKC: ½ -> 1⁄2), then its text
        return tuple(piece.surface or piece.piece for piece in pieces if piece.id == self.unk_id)

    def translation_sources(self, texts: list[str], *, split: bool, truncate: bool,
                            max_rows: int | None = None) -> list[Source]:  # fmt: skip
        """/translate's rows: each text's sentences (the whole text unless `split`), its web and e-mail addresses and
        each run of characters the vocabulary cannot spell replaced by a placeholder, a sentence written all in
        capitals in sentence case, encoded; the text's leading and trailing whitespace kept for its translation.
        Raises TextTooLong naming the text, and TooManySentences as soon as the rows pass `max_rows`, before they
        are encoded (a 1 MB text of 500,000 one-letter lines was 5 s of the event loop, split and encoded, before
        its decode budget refused it)."""
        sources = []
        for t, text in enumerate(texts):
            body = text.strip()
            lead = text[: len(text) - len(text.lstrip())]
            tail = text[len(lead) + len(body) :]
            rows_left = None if max_rows is None else max_rows - len(sources)
            parts = split_sentences(body, rows_left) if split else [(body, "")]
            if rows_left is not None and len(parts) > rows_left:
                raise TooManySentences(max_rows)
            parts[-1] = (parts[-1][0], parts[-1][1] + tail)
            for i, (sentence, gap) in enumerate(parts):
                protected, spans, first = _protect_verbatim(sentence)
                recased = in_sentence_case(protected)  # (after the addresses: they come back as written)
                protected = recased or protected
                try:
                    [encoded] = self.encode_all([protected], truncate=truncate, unknowns=False)
                    if self.unk_id in encoded.ids:  # placeholders for what the vocabulary cannot spell, encoded again
                        protected, unknown_spans, after = self._protect(protected)
                        if recased is not None:  # as written (see in_sentence_case)
                            unknown_spans = tuple(span.upper() for span in unknown_spans)
                        spans, first = spans + unknown_spans, first if spans else after
                        [encoded] = self.encode_all([protected], truncate=truncate)
                except TextTooLong as e:
                    what = "text {index}" if len(parts) == 1 else "a sentence of text {index}"
                    raise TextTooLong(t, e.n_tokens, e.n_max, what) from None
                sources.append(Source(t, encoded, spans, first, gap, lead if i == 0 else "",
                                      braces="{" in sentence or "}" in sentence,
                                      shouted=recased is not None))  # fmt: skip
        return sources

    def translations(self, sources: list[Source], outputs: list[list[int]]) -> list[dict]:
        """The target ids of every row -> {"text", "tokens"} per text: rows decoded, placeholders back to what they
        stand for, sentences joined with the text's own whitespace."""
        texts: list[dict] = []
        for source, ids in zip(sources, outputs, strict=True):
            text = self.decode(list(ids), source.encoded.unknowns)
            if source.shouted:  # (before the placeholders' spans go back in: they come back as written)
                text = text.upper()
            placeholders = {f"{{{n}}}": span for n, span in enumerate(source.spans, source.first)}
            if placeholders and not source.braces:
                text = _without_debris(text, placeholders)
            for placeholder, span in placeholders.items():
                text = text.replace(placeholder, span)
            if source.text == len(texts):
                texts.append({"text": "", "tokens": 0})
            texts[-1]["text"] += source.lead + text + source.gap
            texts[-1]["tokens"] += len(ids)
        return texts

    def _protect(self, text: str) -> tuple[str, tuple[str, ...], int]:
        """The text with each run of characters the vocabulary cannot spell replaced by {n} (numbered after any {n}
        the text has of its own), those runs, and the first n. Whitespace between two such characters stays in
        the run: a line of 40 emoji with spaces between them, as 40 placeholders, came back as braces and digits
        ("1} 🙂 🙂} 🙂}}} { { {"), where one placeholder comes back whole."""
        raw, runs = text.encode("utf-8"), []  # byte offsets, as SentencePiece gives them
        for piece in self._sp.encode(text, return_type="proto").pieces:
            if piece.id == self.unk_id and piece.end > piece.begin:  # (NFKC-made pieces have no source bytes)
                if runs and not raw[runs[-1][1] : piece.begin].strip():
                    runs[-1] = (runs[-1][0], piece.end)
                else:
                    runs.append((piece.begin, piece.end))
        if not runs:
            return text, (), 0
        first = _first_placeholder(text)
        out, last = [], 0
        for n, (begin, end) in enumerate(runs, first):
            out += [raw[last:begin].decode("utf-8"), f"{{{n}}}"]
            last = end
        out.append(raw[last:].decode("utf-8"))
        return "".join(out), tuple(raw[begin:end].decode("utf-8") for begin, end in runs), first

    def decode(self, ids: list[int], unknowns: tuple[str, ...] = ()) -> str:
        """Target ids -> text. An unknown piece the model wrote (SentencePiece renders it " ⁇ ") is replaced by the
        source's unknowns in order, the i-th by the i-th: what the vocabulary cannot spell (an emoji, a name in
        another script) is carried over instead of lost. Unknowns beyond the source's count are dropped."""
        if self.unk_id not in ids:
            return self._sp.decode(ids)
        carried, pieces = iter(unknowns), []
        for i in ids:
            if i != self.unk_id:
                pieces.append(self._sp.id_to_piece(i))
            elif (text := next(carried, None)) is not None:
                pieces.append(text)
            elif pieces and pieces[-1] == "▁":  # dropped, with the word boundary written before it
                pieces.pop()
        return self._sp.decode_pieces(pieces)
