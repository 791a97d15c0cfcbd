"""What the vocabulary cannot spell (emoji, other scripts) is carried from the source into the translation, in
order, instead of coming back as SentencePiece's " ⁇ " (service/tokenizer.py). On the committed bundle."""

from pathlib import Path

import pytest
from conftest import make_settings, running_service

from service.bundle import load_bundle
from service.tokenizer import Tokenizer

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


@pytest.mark.parametrize("beam_size", [1, 4])
async def test_translate_carries_emoji_into_the_translation(beam_size):
    settings = make_settings(MODELS, classify_model="", translate_model=BUNDLE)
    async with running_service(settings) as client:
        response = await client.post("/translate", json={"texts": ["Click 🎉 and then 😀 to finish.", "Save the file."],
                                                         "beam_size": beam_size})  # fmt: skip
    assert response.status_code == 200, response.text
    emoji, plain = (t["text"] for t in response.json()["translations"])
    assert "⁇" not in emoji and emoji.index("🎉") < emoji.index("😀"), emoji
    assert plain == "Speichern Sie die Datei."
