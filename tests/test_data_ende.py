from pathlib import Path

import pytest

from training.ende import (
    Pair,
    align_by_id,
    catalog_pairs,
    clean_pairs,
    description_pairs,
    is_natural_sentence,
    joined_training_pairs,
    parse_ding_line,
    parse_help_html,
    parse_translation_file,
    split_pairs,
    without_gtk_mnemonic,
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


TRANSLATION_DE = """Package: foo-utils
Description-md5: aaa
Description-de: Werkzeuge für Foo
 Foo ist ein Programm, das
 Dinge tut.
 .
 Funktionen:
  * schnell
  * klein und
    leicht
 .
 Dieses Paket enthält die Werkzeuge.

Package: bar
Description-md5: bbb
Description-de: Bar-Bibliothek
 Ein Absatz.
"""

TRANSLATION_EN = """Package: foo-utils
Description-md5: aaa
Description-en: tools for Foo
 Foo is a program that
 does things.
 .
 Features:
  * fast
  * small and
    light
 .
 This package contains the tools.

Package: bar
Description-md5: bbb
Description-en: Bar library
 One paragraph.
 .
 A second paragraph the German lacks.

Package: baz
Description-md5: ccc
Description-en: untranslated
"""


def test_package_descriptions_pair_short_descriptions_paragraphs_and_list_items_by_md5():
    german = parse_translation_file(TRANSLATION_DE, "de")
    english = parse_translation_file(TRANSLATION_EN, "en")
    assert set(english) == {"aaa", "bbb", "ccc"}
    assert description_pairs(german, english) == [
        ("foo-utils", Pair("desc", "tools for Foo", "Werkzeuge für Foo")),
        ("foo-utils", Pair("desc", "Foo is a program that does things.", "Foo ist ein Programm, das Dinge tut.")),
        ("foo-utils", Pair("desc", "Features:", "Funktionen:")),
        ("foo-utils", Pair("desc", "fast", "schnell")),
        ("foo-utils", Pair("desc", "small and light", "klein und leicht")),
        ("foo-utils", Pair("desc", "This package contains the tools.", "Dieses Paket enthält die Werkzeuge.")),
        # bar's long descriptions have 2 English and 1 German paragraph: only the short one pairs
        ("bar", Pair("desc", "Bar library", "Bar-Bibliothek")),
    ]


def test_list_items_that_do_not_match_in_number_pair_as_the_whole_paragraph():
    german = parse_translation_file("Package: x\nDescription-md5: m\nDescription-de: X\n Liste:\n  * a b\n", "de")
    english = parse_translation_file("Package: x\nDescription-md5: m\nDescription-en: X\n List:\n * a\n * b\n", "en")
    assert description_pairs(german, english)[1:] == [("x", Pair("desc", "List: * a * b", "Liste: * a b"))]


def test_gtk_mnemonics_are_removed_but_identifiers_with_several_underscores_kept():
    assert without_gtk_mnemonic("_Open") == "Open"
    assert without_gtk_mnemonic("Ö_ffnen") == "Öffnen"
    assert without_gtk_mnemonic("set my_file_name") == "set my_file_name"


def _pairs_with_descriptions() -> tuple[list[Pair], dict[tuple[str, str], set[str]]]:
    pairs = _synthetic_pairs()
    owners: dict[tuple[str, str], set[str]] = {}
    for package in range(40):
        for line in range(5):
            pair = Pair("desc", f"Package {package} does task number {line}.", f"Paket {package} macht Aufgabe {line}.")
            pairs.append(pair)
            owners[(pair.en, pair.de)] = {f"src{package}"}
    shared = Pair("desc", "This package contains the development files.", "Dieses Paket enthält die Dateien.")
    pairs.append(shared)
    owners[(shared.en, shared.de)] = {f"src{package}" for package in range(40)}
    return pairs, owners


def test_held_out_descriptions_come_from_whole_source_packages_none_of_which_is_trained_on():
    pairs, owners = _pairs_with_descriptions()
    splits = split_pairs(pairs, seed=3, dev_size=40, test_size=60, desc_owners=owners, desc_test_size=12)
    test_desc = [p for p in splits["test"] if p.source == "desc"]
    assert len(test_desc) == 12
    held_packages = {package for p in test_desc for package in owners[(p.en, p.de)]}
    assert len(held_packages) == 3  # 5 pairs each: 3 packages fill 12
    train_packages = {package for p in splits["train"] if p.source == "desc" for package in owners[(p.en, p.de)]}
    assert held_packages.isdisjoint(train_packages)
    # boilerplate shared with a held-out package is neither a test pair nor trained on
    assert not any("development files" in p.en for p in splits["train"] + splits["test"])
    # help and ding held-out pairs are the ones drawn without descriptions
    plain = split_pairs(_synthetic_pairs(), seed=3, dev_size=40, test_size=60)
    assert plain["dev"] == splits["dev"] and plain["test"] == splits["test"][:60]


def test_joined_examples_join_consecutive_pairs_of_one_source_on_both_sides():
    train = [Pair("help", f"Paragraph {i} has these five words.", f"Absatz {i} hat fünf Wörter.") for i in range(200)]
    train += [Pair("ding", f"I saw {i} birds today.", f"Ich sah heute {i} Vögel.") for i in range(50)]
    joined = joined_training_pairs(train, seed=1, count=1000)
    assert joined and all(p.source == "joined" for p in joined)
    for pair in joined:
        numbers = [int(word) for word in pair.en.split() if word.isdigit()]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # consecutive, in order
        assert [int(w) for w in pair.de.split() if w.isdigit()] == numbers  # the same pairs on the German side
        assert 60 <= len(pair.en.split()) <= 180
    assert "birds" not in " ".join(p.en for p in joined)  # ding is not document-ordered: never joined
    assert len(joined_training_pairs(train, seed=1, count=3)) == 3
