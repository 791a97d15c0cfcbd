"""Pretraining: the corpus keeps evaluation texts out, BERT masking, MLM learning, and fine-tuning from it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model import Classifier, MaskedLM, ModelConfig
from tests.tiny_data import make_tiny_imdb
from training.__main__ import main as training_main
from training.corpus import build_documents, dedupe_key, parse_descriptions
from training.imdb import deduplicate, read_imdb_rows, split_reviews
from training.pretrain import MASK_ID, cut_sequences, mask_tokens
from training.reviews import review_splits
from training.tokenizer import BOS_ID, EOS_ID
from training.trainer import load_pretrained_encoder

TINY = ["--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--d-ff", "64"]


def test_adding_rotten_tomatoes_leaves_the_imdb_split_unchanged():
    # IMDB test accuracy of fine-tuned models compares with the earlier models only on the same test reviews.
    before = split_reviews(deduplicate(read_imdb_rows()), 1234)
    after = review_splits(1234)
    for split in ("train", "dev", "test"):
        assert [r.text for r in after[split] if r.source == "imdb"] == [r.text for r in before[split]]
    assert sum(r.source == "rotten_tomatoes" for r in after["test"]) == 1000
    texts = {split: {r.text for r in rows} for split, rows in after.items()}
    assert not texts["train"] & (texts["dev"] | texts["test"])


def test_held_out_texts_never_reach_the_corpus_whatever_their_case_or_spacing():
    held_out = {dedupe_key("A Fine Film, truly."), dedupe_key("Click Save to keep the changes.")}
    sources = {
        "imdb": ["a fine  film, TRULY.", "An honest review of a long film."],
        "ende_en": ["Click Save to keep the changes.", "An honest review of a long film.", "Too short"],
    }
    documents, counts = build_documents(sources, held_out)
    assert [text for _, text in documents] == ["An honest review of a long film."]
    assert counts["imdb"] == {"raw": 2, "kept": 1, "removed_as_held_out": 1}
    assert counts["ende_en"]["removed_as_held_out"] == 1  # the duplicate and the 2-word text are not counted


def test_package_descriptions_become_one_document_each():
    index = (
        "Package: foo\nDescription-md5: 1\nDescription-en: short line about foo\n"
        " Long text about\n foo goes here.\n .\n Second paragraph.\n\n"
        "Package: bar\nDescription-md5: 2\nDescription-en: bar does things\n"
    )
    assert list(parse_descriptions(index)) == [
        "short line about foo Long text about foo goes here. Second paragraph.",
        "bar does things",
    ]


def test_masking_follows_bert_and_never_touches_bos():
    ids = cut_sequences(np.arange(4, 4 + 64 * 511, dtype=np.uint16) % 900 + 4, 512)
    assert ids.shape == (64, 512) and bool((ids[:, 0] == BOS_ID).all())
    inputs, chosen = mask_tokens(ids, 1000, torch.Generator().manual_seed(0))
    assert not chosen[:, 0].any()
    share = chosen.float().mean().item()
    assert 0.14 < share < 0.16
    masked = (inputs == MASK_ID) & chosen
    kept = (inputs == ids) & chosen
    assert 0.77 < masked.sum() / chosen.sum() < 0.83
    assert 0.08 < kept.sum() / chosen.sum() < 0.13  # 10 % kept, plus random draws that hit the same token
    assert bool((inputs[~chosen] == ids[~chosen]).all())  # nothing else changes


def _tiny_corpus(out: Path, tokens: int = 40_000, seed: int = 0) -> Path:
    """A stream only context can predict: each document draws its 32 tokens from its own 3 of the 44 words."""
    rng = np.random.default_rng(seed)
    stream = []
    while len(stream) < tokens:
        topic = rng.choice(np.arange(4, 48), size=3, replace=False)
        stream += list(rng.choice(topic, size=32)) + [EOS_ID]
    out.mkdir(parents=True, exist_ok=True)
    data = np.array(stream, dtype=np.uint16)
    np.save(out / "train.ids.npy", data[: tokens * 9 // 10])
    np.save(out / "dev.ids.npy", data[tokens * 9 // 10 :])
    (out / "meta.json").write_text(json.dumps({"tokenizer": {"vocab_size": 48}, "sha256": {}, "tokens": {},
                                               "sources": {}}))  # fmt: skip
    return out


@pytest.mark.parametrize("attention", ["transformer", "linformer"])
def test_masked_lm_pretraining_lowers_validation_perplexity(tmp_path, attention):
    data = _tiny_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    linformer = ["--k", "16", "--projection", "mean"] if attention == "linformer" else []
    training_main(["pretrain", "--data", str(data), "--attention", attention, *linformer, *TINY, "--n-max", "64",
                   "--seq-len", "64", "--max-steps", "150", "--epochs", "50", "--eval-every", "50", "--lr", "1e-2",
                   "--warmup-steps", "5", "--max-tokens", "1024", "--threads", "1", "--eval-sequences", "32",
                   "--out", str(out)])  # fmt: skip
    curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    perplexities = [r["dev_perplexity"] for r in curve if "dev_perplexity" in r]
    assert len(perplexities) >= 3  # every 20 steps, then the end of the run
    # Every word is equally frequent, so a model that ignores the context cannot beat perplexity 44.
    assert perplexities[-1] < perplexities[0] and perplexities[-1] < 0.6 * 44, perplexities


def test_a_classifier_starts_from_the_pretrained_encoder_at_a_longer_n_max(tmp_path):
    pretrained = MaskedLM(ModelConfig(vocab_size=48, n_max=64, d_model=32, n_heads=2, n_layers=2, d_ff=64, k=16,
                                      projection="mean"))  # fmt: skip
    path = tmp_path / "pretrained.pt"
    torch.save({"model": pretrained.state_dict(), "model_config": pretrained.cfg.__dict__}, path)
    classifier = Classifier(ModelConfig(vocab_size=48, n_max=256, d_model=32, n_heads=2, n_layers=2, d_ff=64, k=64,
                                        projection="mean"))  # fmt: skip
    with pytest.raises(ValueError, match="k"):  # k = 64 windows over 256 is not what was pretrained
        load_pretrained_encoder(classifier, path)
    classifier = Classifier(ModelConfig(vocab_size=48, n_max=256, d_model=32, n_heads=2, n_layers=2, d_ff=64, k=16,
                                        projection="mean"))  # fmt: skip
    load_pretrained_encoder(classifier, path)
    for name, value in pretrained.encoder.state_dict().items():
        assert torch.equal(classifier.encoder.state_dict()[name], value), name


def test_classify_cli_fine_tunes_from_a_pretrain_checkpoint(tmp_path):
    data = make_tiny_imdb(tmp_path / "imdb")
    corpus = _tiny_corpus(tmp_path / "corpus")
    model = [*TINY, "--attention", "linformer", "--k", "16", "--projection", "mean"]
    training_main(["pretrain", "--data", str(corpus), *model, "--n-max", "64", "--seq-len", "64", "--max-steps", "3",
                   "--max-tokens", "256", "--threads", "1", "--eval-sequences", "4", "--out", str(tmp_path / "pt")])
    training_main(["classify", "--data", str(data), *model, "--n-max", "128", "--max-steps", "2", "--epochs", "1",
                   "--max-tokens", "1024", "--threads", "1", "--init-from", str(tmp_path / "pt" / "best.pt"),
                   "--out", str(tmp_path / "ft")])  # fmt: skip
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["init_from"]["checkpoint"].endswith("best.pt")
    assert summary["init_from"]["model_config"]["n_max"] == 64
