from pathlib import Path

import pytest

from training.imdb import Review, clean_text, deduplicate, split_reviews, write_tsv
from training.tokenizer import read_tsv_column


def test_br_tags_become_spaces_in_every_spelling():
    assert clean_text("Great.<br /><br />Really.") == "Great. Really."
    assert clean_text("a<br/>b<br>c<BR />d") == "a b c d"


def test_whitespace_including_tabs_and_newlines_collapses_to_single_spaces():
    assert clean_text("  one\ttwo\n\nthree \r\n four  ") == "one two three four"


def test_other_markup_is_kept():
    assert clean_text("<i>Casablanca</i> rules") == "<i>Casablanca</i> rules"


def test_duplicates_after_cleaning_keep_one_copy_in_first_seen_order():
    rows = [Review(1, "Good  film"), Review(0, "Bad film"), Review(1, "Good<br />film")]
    assert deduplicate(rows) == [Review(1, "Good film"), Review(0, "Bad film")]


def test_text_seen_with_conflicting_labels_is_dropped_entirely():
    rows = [Review(1, "Odd film"), Review(0, "Fine film"), Review(0, "Odd film"), Review(1, "Odd film")]
    assert deduplicate(rows) == [Review(0, "Fine film")]


def test_empty_texts_are_dropped():
    assert deduplicate([Review(0, " <br /> "), Review(1, "ok")]) == [Review(1, "ok")]


def _synthetic(count: int) -> list[Review]:
    return [Review(i % 2, f"review number {i}") for i in range(count)]


def test_splits_are_disjoint_cover_everything_and_have_the_requested_sizes():
    rows = _synthetic(500)
    splits = split_reviews(rows, seed=7, dev_size=50, test_size=60)
    assert (len(splits["train"]), len(splits["dev"]), len(splits["test"])) == (390, 50, 60)
    texts = {name: {text for _, text in part} for name, part in splits.items()}
    assert not texts["train"] & texts["dev"]
    assert not texts["train"] & texts["test"]
    assert not texts["dev"] & texts["test"]
    assert texts["train"] | texts["dev"] | texts["test"] == {text for _, text in rows}


def test_split_is_deterministic_under_the_seed_and_changes_with_it():
    rows = _synthetic(500)
    first = split_reviews(rows, seed=7, dev_size=50, test_size=60)
    assert split_reviews(list(rows), seed=7, dev_size=50, test_size=60) == first
    assert split_reviews(rows, seed=8, dev_size=50, test_size=60)["test"] != first["test"]


def test_split_refuses_when_dev_and_test_leave_no_training_data():
    with pytest.raises(ValueError):
        split_reviews(_synthetic(10), seed=1, dev_size=5, test_size=5)


def test_tsv_round_trips_texts_with_quotes_and_backslashes(tmp_path: Path):
    rows = [Review(1, 'He said "wow" \\ twice'), Review(0, "'single' quotes")]
    write_tsv(tmp_path / "x.tsv", rows)
    assert list(read_tsv_column(tmp_path / "x.tsv", "text")) == [text for _, text in rows]
