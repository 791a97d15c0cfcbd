from pathlib import Path

import pytest

from training.ende import (
    Pair,
    align_by_id,
    catalog_pairs,
    clean_pairs,
    is_natural_sentence,
    parse_ding_line,
    parse_help_html,
    split_pairs,
    write_tsv,
)
from training.tokenizer import read_tsv_column

EN_HTML = """<html><head><title>Fields</title></head><body>
<h1 id="hd_1" dir="auto">Fields</h1>
<p id="par_2" class="paragraph"><span class="avis">Inserts a <b>field</b>.</span>
   Use&nbsp;it &amp; enjoy.</p>
<p class="howtogetheader">To access this command...</p>
<p id="par_3">Choose <span class="menuitem">Insert - Field</span><br>now</p>
<p id="only_en">Not translated.</p>
<p id="par_2">A later copy of an id is ignored.</p>
</body></html>"""

DE_HTML = """<html><body>
<h1 id="hd_1">Felder</h1>
<p id="par_3">Wählen Sie <span class="menuitem">Einfügen - Feld</span><br/>jetzt</p>
<p id="par_2"><span class="avis">Fügt ein <b>Feld</b> ein.</span> Nutzen &amp; genießen.</p>
</body></html>"""


def test_help_html_text_has_tags_stripped_entities_unescaped_and_whitespace_collapsed():
    texts = parse_help_html(EN_HTML)
    assert texts["hd_1"] == "Fields"
    assert texts["par_2"] == "Inserts a field. Use it & enjoy."
    assert texts["par_3"] == "Choose Insert - Field now"


def test_elements_without_id_are_ignored_and_the_first_copy_of_an_id_wins():
    texts = parse_help_html(EN_HTML)
    assert set(texts) == {"hd_1", "par_2", "par_3", "only_en"}


def test_help_pairs_are_aligned_by_equal_ids_regardless_of_order():
    pairs = align_by_id(parse_help_html(EN_HTML), parse_help_html(DE_HTML))
    assert pairs == [
        ("Fields", "Felder"),
        ("Inserts a field. Use it & enjoy.", "Fügt ein Feld ein. Nutzen & genießen."),
        ("Choose Insert - Field now", "Wählen Sie Einfügen - Feld jetzt"),
    ]


def test_ui_catalog_drops_header_context_accelerators_and_extra_plural_forms():
    catalog = {
        "": "Project-Id-Version: x\n",
        "STR_OPEN\x04~Open File": "Datei ö~ffnen",
        ("%1 page", 0): "%1 Seite",
        ("%1 page", 1): "%1 Seiten",
    }
    assert catalog_pairs(catalog) == [("Open File", "Datei öffnen"), ("%1 page", "%1 Seite")]


def test_ding_line_pairs_sub_entries_and_first_synonyms_without_annotations():
    line = (
        "Abendessen {n}; Abendbrot {n} | Abendessen {pl} | Das Abendessen hat mir geschmeckt. [ugs.] :: "
        "supper; evening meal | suppers | I enjoyed my supper. [Br.]\n"
    )
    assert parse_ding_line(line) == [
        ("supper", "Abendessen"),
        ("suppers", "Abendessen"),
        ("I enjoyed my supper.", "Das Abendessen hat mir geschmeckt."),
    ]


def test_ding_comments_and_lines_with_unequal_sub_entry_counts_give_nothing():
    assert parse_ding_line("# Version :: devel 2023-01-30\n") == []
    assert parse_ding_line("Haus {n} | Häuser {pl} :: house\n") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I enjoyed my supper.", True),
        ("Would you like to have dinner with me?", True),
        ("No humping at all!", True),
        ("No humping!", False),  # two words
        ("to have a deep tan", False),  # not capitalised, no final punctuation
        ("Evening meal included", False),  # no final punctuation
    ],
)
def test_natural_sentence_filter(text: str, expected: bool):
    assert is_natural_sentence(text) is expected


def test_cleaning_drops_untranslated_overlong_mismatched_and_duplicate_pairs():
    pairs = [
        Pair("help", "Choose Format", "Wählen Sie Format"),
        Pair("help", "LibreOffice", "LibreOffice"),
        Pair("ui", "Choose Format", "Wählen Sie Format"),
        Pair("help", "word " * 121, "Wort " * 121),
        Pair("help", "one two three four five six seven", "eins"),
        Pair("ui", "", "leer"),
    ]
    assert clean_pairs(pairs) == [Pair("help", "Choose Format", "Wählen Sie Format")]


def _synthetic_pairs() -> list[Pair]:
    pairs = [Pair("help", f"Click the button number {i}.", f"Klicken Sie Knopf {i}.") for i in range(300)]
    pairs += [Pair("ding", f"I saw {i} birds today.", f"Ich sah heute {i} Vögel.") for i in range(300)]
    pairs += [Pair("ui", f"Button {i}", f"Knopf {i}") for i in range(100)]
    # The same English with another translation, and the same German with another English.
    pairs += [Pair("ui", f"Click the button number {i}.", f"Knopf {i} anklicken.") for i in range(300)]
    pairs += [Pair("ui", f"i SAW {i} BIRDS TODAY.", f"Vögel {i}") for i in range(300)]
    pairs += [Pair("ui", f"Press button {i}", f"Klicken Sie Knopf {i}.") for i in range(300)]
    return pairs


def test_no_held_out_english_or_german_text_appears_in_training():
    splits = split_pairs(_synthetic_pairs(), seed=3, dev_size=40, test_size=60)
    held = splits["dev"] + splits["test"]
    held_en = {p.en.casefold() for p in held}
    held_de = {p.de.casefold() for p in held}
    assert all(p.en.casefold() not in held_en and p.de.casefold() not in held_de for p in splits["train"])
    assert len(held_en) == len(held) == 100  # no English text repeats across dev and test
    assert {p.en for p in splits["dev"]}.isdisjoint({p.en for p in splits["test"]})


def test_held_out_sets_are_half_help_half_ding_and_never_ui():
    splits = split_pairs(_synthetic_pairs(), seed=3, dev_size=40, test_size=60)
    assert [p.source for p in splits["test"]].count("help") == 30
    assert [p.source for p in splits["test"]].count("ding") == 30
    assert [p.source for p in splits["dev"]].count("help") == 20
    assert not any(p.source == "ui" for p in splits["dev"] + splits["test"])


def test_split_is_deterministic_under_the_seed():
    pairs = _synthetic_pairs()
    first = split_pairs(pairs, seed=3, dev_size=40, test_size=60)
    assert split_pairs(list(pairs), seed=3, dev_size=40, test_size=60) == first
    assert split_pairs(pairs, seed=4, dev_size=40, test_size=60)["test"] != first["test"]


def test_split_refuses_when_there_are_too_few_candidates():
    with pytest.raises(ValueError):
        split_pairs(_synthetic_pairs()[:20], seed=3, dev_size=40, test_size=60)


def test_tsv_round_trips_pairs_with_quotes(tmp_path: Path):
    pairs = [Pair("help", 'Type "=SUM(A1)"', 'Geben Sie "=SUMME(A1)" ein')]
    write_tsv(tmp_path / "p.tsv", pairs)
    assert list(read_tsv_column(tmp_path / "p.tsv", "de")) == [pairs[0].de]
