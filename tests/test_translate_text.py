"""What people type into /translate, on the committed bundle: paragraphs (each sentence is translated on its own and
the text's spacing and line breaks are kept), and what the vocabulary cannot spell (emoji, other scripts: carried
from the source into the translation, in order, instead of SentencePiece's " ⁇ "). service/tokenizer.py."""

from pathlib import Path

import numpy as np
import pytest
from conftest import make_settings, running_service

from service.bundle import load_bundle
from service.tokenizer import Tokenizer, _protect_verbatim, in_sentence_case, split_sentences

pytestmark = pytest.mark.anyio

MODELS = Path(__file__).resolve().parents[1] / "models"
BUNDLE = "translate-linformer"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_bundle(load_bundle(MODELS / BUNDLE))


def test_the_source_keeps_the_text_of_each_unknown_piece_in_order(tokenizer):
    [encoded] = tokenizer.encode_all(["Click 🎉 and then 😀 to finish."], truncate=False)
    assert encoded.ids.count(tokenizer.unk_id) == 2 and encoded.unknowns == ("🎉", "😀")
    [plain] = tokenizer.encode_all(["Save the file."], truncate=False)
    assert tokenizer.unk_id not in plain.ids and plain.unknowns == ()
    # normalisation (NFKC) makes ½ into 1⁄2: the unknown piece has no source characters of its own, so its text
    [fraction] = tokenizer.encode_all(["½"], truncate=False)
    assert fraction.unknowns == ("⁄",)


def test_a_truncated_source_keeps_only_the_unknowns_of_what_it_kept(tokenizer):
    text = "😀 " + "word " * 300 + "🎉"
    [encoded] = tokenizer.encode_all([text], truncate=True)
    assert encoded.truncated and encoded.unknowns == ("😀",)


def test_decode_puts_the_sources_unknowns_where_the_model_wrote_unknown_pieces(tokenizer):
    target = tokenizer._sp.encode("Klicken Sie auf 🎉 und dann auf 😀.")  # the emoji encode as unknown pieces
    assert target.count(tokenizer.unk_id) == 2
    assert tokenizer.decode(target, ("🎉", "😀")) == "Klicken Sie auf 🎉 und dann auf 😀."
    # more unknowns written than the source had: the extra ones are dropped, with their word boundary
    assert tokenizer.decode(target, ("🎉",)) == "Klicken Sie auf 🎉 und dann auf."
    assert tokenizer.decode(target) == "Klicken Sie auf und dann auf."
    # no unknown piece: SentencePiece's own decoding, untouched
    plain = tokenizer._sp.encode("Speichern Sie die Datei.")
    assert tokenizer.decode(plain, ("🎉",)) == tokenizer._sp.decode(plain) == "Speichern Sie die Datei."


def test_what_the_vocabulary_cannot_spell_becomes_a_placeholder_in_the_source(tokenizer):
    assert tokenizer._protect("Press 😀 to continue.") == ("Press {1} to continue.", ("😀",), 1)
    # runs of unknown pieces side by side are one placeholder; a known piece between them makes two
    assert tokenizer._protect("a😀🎉b") == ("a{1}b", ("😀🎉",), 1)
    assert tokenizer._protect("Contact ŁÓDŹ now") == ("Contact {1}D{2} now", ("ŁÓ", "Ź"), 1)
    # and only whitespace between them too: a line of 40 spaced emoji as 40 placeholders came back as braces
    assert tokenizer._protect("Rate it: 😀 😀\t😀  🎉 ok") == ("Rate it: {1} ok", ("😀 😀\t😀  🎉",), 1)
    # the text's own {n} keep their numbers: ours come after them
    assert tokenizer._protect("Use {1} or {3} for 李明.") == ("Use {1} or {3} for {4}.", ("李明",), 4)
    assert tokenizer._protect("Save the file.") == ("Save the file.", (), 0)
    protected, _, _ = tokenizer._protect("Press 😀 to continue.")
    assert tokenizer.unk_id not in tokenizer.encode_all([protected], truncate=False)[0].ids


def test_placeholder_debris_is_dropped_from_a_translation_unless_the_source_had_braces_of_its_own(tokenizer):
    """With many placeholders in one sentence the translators write some of them broken ("🙂}}", "{4eat}",
    "Grate8}"): braces and digits that were never in the text. Where the sentence had no brace of its own they are
    dropped, with the double space they leave; whole placeholders come back as what they stand for."""
    [source] = tokenizer.translation_sources(["Click 🙂 then 🎉 then ✓."], split=True, truncate=False)
    assert source.spans == ("🙂", "🎉", "✓") and not source.braces
    written = tokenizer._sp.encode("Klicken Sie auf {1}} dann {2 und 3} {4eat} {3}.")
    assert tokenizer.translations([source], [written])[0]["text"] == "Klicken Sie auf 🙂 dann und eat ✓."
    [own] = tokenizer.translation_sources(["Use {x} then 🎉."], split=True, truncate=False)
    assert own.braces
    written = tokenizer._sp.encode("Nutze {x} dann {1}}.")
    assert tokenizer.translations([own], [written])[0]["text"] == "Nutze {x} dann 🎉}."


class Echo:
    """wrap_runtime: every row's "translation" is its own source (EOS dropped): what comes back is what the service
    made of the text on the way in and out (sentences, placeholders, unknown pieces, spacing). It answers whole
    batches (`run`), so the service runs it under request scheduling (ECHO_SETTINGS)."""

    def __init__(self, runtime):
        self.runtime = runtime

    def run(self, input_ids, attention_mask, options, between_steps=None):
        return [row[: int(mask.sum()) - 1].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]


ECHO_SETTINGS = {"translate_scheduling": "request"}


async def test_translate_puts_back_what_each_placeholder_stands_for():
    texts = ["Click 🎉 and then 😀 to finish.", "Use {1} for 李明.\n\nThen press 💾.", "Contact ŁÓDŹ now.",
             "No unknowns."]
    settings = make_settings(MODELS, classify_model="", translate_model=BUNDLE, **ECHO_SETTINGS)
    async with running_service(settings, wrap_runtime=Echo) as client:
        response = await client.post("/translate", json={"texts": texts})
    assert response.status_code == 200, response.text
    assert [t["text"] for t in response.json()["translations"]] == texts


@pytest.mark.parametrize(
    ("text", "read_as"),
    [
        ("THE FILE COULD NOT BE SAVED.", "The file could not be saved."),
        ('CLICK OK. "SAVE" IT! (THEN) CLOSE? YES…  DONE', 'Click ok. "Save" it! (Then) close? Yes…  Done'),
        ("  ÄRGER IM BÜRO. ÜBER ПРИВЕТ 🙂", "  Ärger im büro. Über привет 🙂"),
        ("İSTANBUL IS BIG", "İstanbul is big"),  # İ's lower case is two characters: ASCII letters only
        ("VISIT {1} NOW", "Visit {1} now"),
        ("Save the file.", None), ("a FILE", None), ("123 - 45", None), ("🙂", None),
    ],
)
def test_text_written_all_in_capitals_is_read_in_sentence_case(text, read_as):
    assert in_sentence_case(text) == read_as
    if read_as is not None:
        assert read_as.upper() == text.upper()


async def test_a_sentence_in_capitals_is_translated_in_sentence_case_and_answered_in_capitals():
    """300 help sentences in capitals: BLEU 1.1 read as written, 27.8 in sentence case. The translation
    of a sentence in capitals is that of its sentence case, in capitals; what the sentence carries over unread
    (addresses, what the vocabulary cannot spell) comes back as written."""
    async with running_service(make_settings(MODELS, classify_model="", translate_model=BUNDLE)) as client:
        loud = await client.post("/translate", json={"text": "THE FILE COULD NOT BE SAVED.\nClose the window."})
        cased = await client.post("/translate", json={"texts": ["The file could not be saved.", "Close the window."]})
    assert loud.status_code == cased.status_code == 200
    first, second = (t["text"] for t in cased.json()["translations"])
    assert loud.json()["translations"][0]["text"] == f"{first.upper()}\n{second}"
    texts = ["VISIT https://Example.org/Path NOW. WRITE TO Info@Example.org, ПРИВЕТ 🙂 ŁÓDŹ.", "SAVE IT"]
    settings = make_settings(MODELS, classify_model="", translate_model=BUNDLE, **ECHO_SETTINGS)
    async with running_service(settings, wrap_runtime=Echo) as client:
        echoed = await client.post("/translate", json={"texts": texts})
    assert [t["text"] for t in echoed.json()["translations"]] == texts


def test_a_sentence_in_capitals_goes_to_the_model_in_sentence_case_with_its_placeholders(tokenizer):
    [loud] = tokenizer.translation_sources(["VISIT https://Example.org NOW 🙂"], split=True, truncate=False)
    [cased] = tokenizer.translation_sources(["Visit https://Example.org now 🙂"], split=True, truncate=False)
    assert loud.encoded.ids == cased.encoded.ids and loud.spans == cased.spans == ("https://Example.org", "🙂")
    assert loud.shouted and not cased.shouted


def test_web_and_e_mail_addresses_become_placeholders_without_their_closing_punctuation():
    assert _protect_verbatim("Visit https://www.libreoffice.org/ or write to info@example.com.") == (
        "Visit {1} or write to {2}.", ("https://www.libreoffice.org/", "info@example.com"), 1)
    assert _protect_verbatim("See (http://a.org/x?y=1&z=2), then www.b.de/c.") == (
        "See ({1}), then {2}.", ("http://a.org/x?y=1&z=2", "www.b.de/c"), 1)
    assert _protect_verbatim('Mail "a.b+c@d-e.co.uk"! Or ftp://f.org.') == (
        'Mail "{1}"! Or {2}.', ("a.b+c@d-e.co.uk", "ftp://f.org"), 1)
    assert _protect_verbatim("Use {2} and https://x.org") == ("Use {2} and {3}", ("https://x.org",), 3)
    for plain in ("Version 2.5 is out.", "Use e.g. Writer. Then save.", "a.b is no address", "x @ y.z"):
        assert _protect_verbatim(plain) == (plain, (), 0)


def test_sentence_splitting_and_addresses_take_linear_time_on_text_made_to_be_slow():
    """Both run on the event loop, before any length check. They were quadratic: 900 KB of initials took 16 s to
    split (every period looked back at the whole unsplit run), 40 KB of spaces 3 s (each space began a scan for a
    line break to the run's end), 40 KB of "a.a.a..." 14 s to scan for addresses (every word boundary started a scan
    to the text's end). Linear, each takes well under a second here; the bound leaves
    room for a slow machine and still fails the quadratic forms by far."""
    import time

    initials = "A. " * 200_000  # 600 KB, no sentence boundary: one sentence
    started = time.perf_counter()
    assert len(split_sentences(initials)) == 1
    assert time.perf_counter() - started < 3.0
    spaces = "x" + " \t" * 100_000 + "y"  # 200 KB of spaces and tabs with no line break (quadratic: 75 s)
    started = time.perf_counter()
    assert split_sentences(spaces) == [(spaces, "")]
    assert time.perf_counter() - started < 2.0
    boundaries = "a." * 20_000 + "@"  # a word boundary at every character, and an @ so the scan runs
    started = time.perf_counter()
    assert _protect_verbatim(boundaries) == (boundaries, (), 0)
    assert time.perf_counter() - started < 2.0


async def test_translate_gives_back_addresses_and_the_texts_own_spacing_as_they_were():
    texts = ["\n\n  Visit https://www.libreoffice.org/ or write to users@global.libreoffice.org.\r\nThen 😀.\n",
             "Mail 李明 at li@example.cn, see www.example.com/a?b=1.  ", "\tNo addresses.\r\n\r\n",
             "Fill in {2} at https://example.org/{1}/{3} or {1}.",  # the text's own {n}, one inside an address
             "See {" + "9" * 20 + "} and {1234567890} at www.example.org 😀."]  # {n} too long to be ours
    settings = make_settings(MODELS, classify_model="", translate_model=BUNDLE, **ECHO_SETTINGS)
    async with running_service(settings, wrap_runtime=Echo) as client:
        response = await client.post("/translate", json={"texts": texts})
        whole = await client.post("/translate", json={"texts": texts, "split_sentences": False})
        # a {n} longer than Python converts to an integer (4,300 digits), before an address: an answer, not a 500
        huge = "😀 {" + "9" * 5000 + "} www.example.org"
        huge = await client.post("/translate", json={"text": huge, "truncate": True})
    assert huge.status_code == 200, huge.text
    assert response.status_code == whole.status_code == 200, response.text
    assert [t["text"] for t in response.json()["translations"]] == texts
    # in one piece, a line break inside the text is the model's to keep (SentencePiece reads it as a space); the
    # text's leading and trailing whitespace is the service's
    assert [t["text"] for t in whole.json()["translations"]] == [texts[0].replace(".\r\nThen", ". Then"), *texts[1:]]


async def test_the_translator_keeps_a_web_address_it_would_otherwise_break():
    text = "Visit https://help.libreoffice.org/latest/en-US/text/main.html for more information."
    async with running_service(make_settings(MODELS, classify_model="", translate_model=BUNDLE)) as client:
        response = await client.post("/translate", json={"text": text})
    assert response.status_code == 200, response.text
    assert "https://help.libreoffice.org/latest/en-US/text/main.html" in response.json()["translations"][0]["text"]


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("Open the file. Then save it. Close the window.", ["Open the file.", "Then save it.", "Close the window."]),
        ("Click Save.\nThen close the dialog.", ["Click Save.", "Then close the dialog."]),
        ("  Line one\n\n  Line two  ", ["Line one", "Line two"]),  # no full stop needed before a line break
        ('He said "Stop." Then he left! Why? 3 tries… OK.',
         ['He said "Stop."', "Then he left!", "Why?", "3 tries…", "OK."]),
        ("Use e.g. Writer or Calc. See Fig. 2 below.", ["Use e.g. Writer or Calc.", "See Fig. 2 below."]),
        ("J. R. R. Tolkien wrote it. No! It was Mr. Smith.",
         ["J. R. R. Tolkien wrote it.", "No!", "It was Mr. Smith."]),
        ("Version 2.5 is out. lower case goes on", ["Version 2.5 is out. lower case goes on"]),
        ("one", ["one"]),
    ],
)
def test_sentences_end_at_line_breaks_and_at_full_stops_before_a_capital(text, sentences):
    parts = split_sentences(text)
    assert [sentence for sentence, _ in parts] == sentences
    assert "".join(sentence + gap for sentence, gap in parts) == text.strip()  # nothing lost, spacing kept


async def test_a_paragraph_is_translated_sentence_by_sentence_with_its_line_breaks():
    first, second = "Click the Save button to store your changes.", "Then close the dialog."
    async with running_service(make_settings(MODELS, classify_model="", translate_model=BUNDLE)) as client:
        alone = await client.post("/translate", json={"texts": [first, second]})
        together = await client.post("/translate", json={"text": f"{first}\n{second}"})
        whole = await client.post("/translate", json={"text": f"{first}\n{second}", "split_sentences": False})
    assert alone.status_code == together.status_code == whole.status_code == 200
    (one, two), [joined] = alone.json()["translations"], together.json()["translations"]
    assert joined == {"text": f"{one['text']}\n{two['text']}", "tokens": one["tokens"] + two["tokens"]}
    # in one piece the second line got lost: the model saw one segment, and wrote one
    assert "\n" not in whole.json()["translations"][0]["text"]


async def test_the_decode_budget_and_the_length_limit_count_sentences(tokenizer):
    three = "Open the file. Then save it. Close the window."
    # each sentence may generate min(max_new_tokens, 2 x its tokens + 16): the budget counts that, per sentence
    sentences = tokenizer.encode_all([s for s, _ in split_sentences(three)], truncate=False)
    asked = sum(min(40, 2 * len(e.ids) + 16) for e in sentences)
    settings = make_settings(MODELS, classify_model="", translate_model=BUNDLE, max_decode_tokens_per_request=asked - 1)
    async with running_service(settings) as client:
        over = await client.post("/translate", json={"text": three, "max_new_tokens": 40})
        whole = await client.post("/translate", json={"text": three, "max_new_tokens": 40, "split_sentences": False})
        paragraph = "Open it. Then " + "save it " * 150  # a short sentence, then one of 300 tokens
        long = await client.post("/translate", json={"text": paragraph, "max_new_tokens": 20})
        cut = await client.post("/translate", json={"text": paragraph, "max_new_tokens": 20, "truncate": True})
    assert over.status_code == 413 and over.json()["error"]["code"] == "budget_exceeded"
    assert f"3 sentences x beam_size 1 may generate {asked} decode tokens" in over.json()["error"]["message"]
    assert whole.status_code == 200, whole.text  # one row: at most 40
    assert long.status_code == 413 and long.json()["error"]["message"].startswith("a sentence of text 0 is ")
    assert cut.status_code == 200 and len(cut.json()["translations"]) == 1, cut.text


def test_a_translation_may_be_at_most_twice_its_source_plus_16_tokens(tokenizer):
    from service.app import make_runtime
    from service.runtime import LiveDecode

    bundle = load_bundle(MODELS / BUNDLE)
    runtime = make_runtime(bundle, ["CPUExecutionProvider"], make_settings(MODELS, translate_model=BUNDLE))
    live = LiveDecode(runtime)
    ids = [e.ids for e in tokenizer.encode_all(["Click OK.", "Save the file now, please."], truncate=False)]
    input_ids = np.zeros((2, max(map(len, ids))), np.int64)
    mask = np.zeros_like(input_ids)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    live.admit(input_ids, mask, [("ok", (1, 256)), ("save", (2, 20))])
    limits = {search.key: search.max_new_tokens for search in live.searches}
    assert limits == {"ok": 2 * len(ids[0]) + 16, "save": 20}  # max_new_tokens when it is the smaller
    live.drop({"ok", "save"})
