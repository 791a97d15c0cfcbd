"""Properties of the model library that the serving stack relies on (issue 2)."""

import itertools

import pytest
import torch

from model import Classifier, Encoder, ModelConfig, Translator, count_projection_matrices
from model.linformer import PROJECTIONS, SHARING, LowRankProjection

torch.manual_seed(0)


def small(**overrides) -> ModelConfig:
    base = dict(vocab_size=50, n_max=64, d_model=32, n_heads=4, n_layers=3, d_ff=64, k=16, dropout=0.0)
    return ModelConfig(**{**base, **overrides})


def random_ids(cfg: ModelConfig, *shape: int) -> torch.Tensor:
    return torch.randint(4, cfg.vocab_size, shape)


def pad_batch(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


@pytest.mark.parametrize("sharing", ["layerwise", "none"])
def test_linformer_with_identity_projection_equals_vanilla_attention(sharing):
    n = 24
    vanilla = Encoder(small(attention="transformer", n_max=n, k=n)).eval()
    linformer = Encoder(small(attention="linformer", n_max=n, k=n, sharing=sharing)).eval()
    missing, unexpected = linformer.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("projections.") for name in missing)
    with torch.no_grad():
        for p in linformer.projections:
            p.weight.copy_(torch.eye(n).expand_as(p.weight))
    ids = random_ids(vanilla.cfg, 2, n)
    keep = torch.ones(2, n, dtype=torch.bool)
    torch.testing.assert_close(linformer(ids, keep), vanilla(ids, keep), atol=1e-5, rtol=1e-5)
    # and the projection really is used: a different E gives a different answer
    with torch.no_grad():
        linformer.projections[0].weight.mul_(0.5)
    assert not torch.allclose(linformer(ids, keep), vanilla(ids, keep), atol=1e-3)


CASES = [("transformer", "linear", "layerwise"), ("performer", "linear", "layerwise")] + [
    ("linformer", projection, sharing) for projection, sharing in itertools.product(PROJECTIONS, SHARING)
]


@pytest.mark.parametrize("attention,projection,sharing", CASES)
def test_output_is_invariant_to_padding(attention, projection, sharing):
    cfg = small(attention=attention, projection=projection, sharing=sharing)
    model = Classifier(cfg).eval()
    short, long = random_ids(cfg, 13), random_ids(cfg, 57)
    with torch.no_grad():
        alone_h = model.encoder(short[None], torch.ones(1, 13, dtype=torch.bool))
        alone = model(short[None], torch.ones(1, 13, dtype=torch.long))
        ids, mask = pad_batch([short, long])
        batched_h = model.encoder(ids, mask.bool())
        batched = model(ids, mask)
    torch.testing.assert_close(batched_h[0, :13], alone_h[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)


def test_padding_would_leak_if_it_were_not_removed_before_projecting(monkeypatch):
    """The invariance test above can fail: projecting padded rows (fairseq's bug) changes the output."""
    cfg = small(attention="linformer", sharing="headwise")
    model = Classifier(cfg).eval()
    short, long = random_ids(cfg, 13), random_ids(cfg, 57)
    ids, mask = pad_batch([short, long])
    with torch.no_grad():
        alone = model.encoder(short[None], torch.ones(1, 13, dtype=torch.bool))
        forward = LowRankProjection.forward
        monkeypatch.setattr(LowRankProjection, "forward", lambda self, x, keep: forward(self, x, keep | True))
        for projection in model.encoder.projections:  # take the per-head path, which uses forward()
            monkeypatch.setattr(projection, "input_first", False)
        leaky = model.encoder(ids, mask.bool())
    # the invariance test allows 1e-5; the leak moves hidden states by ~5e-3 to 1e-2 at this init
    assert (leaky[0, :13] - alone[0]).abs().max() > 1e-3


def test_non_uniform_k_per_layer_builds_and_stays_padding_invariant():
    cfg = small(k=[32, 16, 8], sharing="headwise")
    model = Classifier(cfg).eval()
    assert [p.k for p in model.encoder.projections] == [32, 32, 16, 16, 8, 8]
    short, long = random_ids(cfg, 20), random_ids(cfg, 64)
    ids, mask = pad_batch([short, long])
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, mask)[0], model(short[None], torch.ones(1, 20, dtype=torch.long))[0], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "sharing,expected", [("none", 2 * 12 * 12), ("headwise", 24), ("key-value", 12), ("layerwise", 1)]
)
def test_distinct_projection_matrices_match_the_paper(sharing, expected):
    cfg = ModelConfig(vocab_size=10, n_max=16, d_model=48, n_heads=12, n_layers=12, d_ff=48, k=4, sharing=sharing)
    encoder = Encoder(cfg)
    assert count_projection_matrices(encoder) == expected
    distinct = {id(p) for p in encoder.projections.parameters()}
    assert len(distinct) == len(list(encoder.projections))  # no module registered twice


def test_mean_initialised_linear_projection_starts_as_mean_pooling_and_is_learned():
    linear = LowRankProjection("linear", 4, 16, 1, init="mean")
    pooling = LowRankProjection("mean", 4, 16, 1)
    x, keep = torch.randn(2, 1, 16, 8), torch.ones(2, 16, dtype=torch.bool)
    torch.testing.assert_close(linear(x, keep)[0], pooling(x, keep)[0])
    assert linear.weight.requires_grad and linear.num_matrices == 1
    short = torch.randn(1, 1, 6, 8)  # a short input fills only the first windows
    rows = linear(short, torch.ones(1, 6, dtype=torch.bool))[0][0, 0]
    torch.testing.assert_close(rows[1], short[0, 0, 4:6].sum(0) / 4)
    assert not rows[2:].any()


def test_input_longer_than_n_max_is_an_error():
    cfg = small()
    model = Classifier(cfg).eval()
    with pytest.raises(ValueError, match="n_max=64"):
        model(random_ids(cfg, 1, 65), torch.ones(1, 65, dtype=torch.long))


def test_config_round_trips_through_json_and_rebuilds_the_same_model():
    cfg = small(k=[32, 16, 8], sharing="key-value", projection="conv", num_labels=3)
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg
    model, rebuilt = Classifier(cfg).eval(), Classifier(again).eval()
    rebuilt.load_state_dict(model.state_dict())  # strict: same parameter names and shapes
    ids = random_ids(cfg, 2, 40)
    mask = torch.ones(2, 40, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, mask), model(ids, mask))


def translator(cross_attention: str = "linformer", attention: str = "linformer") -> Translator:
    cfg = small(n_decoder_layers=2, tgt_n_max=32, attention=attention, cross_attention=cross_attention, k_cross=8)
    return Translator(cfg).eval()


# (encoder and decoder self-attention, cross-attention): the Performer's decoder is causal FAVOR+
DECODERS = [("linformer", "linformer"), ("linformer", "transformer"), ("performer", "transformer")]


@pytest.mark.parametrize("attention,cross_attention", DECODERS)
def test_decoder_is_causal(attention, cross_attention):
    model = translator(cross_attention, attention)
    src = random_ids(model.cfg, 2, 20)
    src_mask = torch.ones(2, 20, dtype=torch.long)
    tgt = random_ids(model.cfg, 2, 12)
    t = 5
    changed = tgt.clone()
    changed[:, t + 1 :] = random_ids(model.cfg, 2, 12 - t - 1)
    with torch.no_grad():
        a, b = model(src, src_mask, tgt), model(src, src_mask, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :], atol=1e-3)  # later positions do see them


@pytest.mark.parametrize("attention,cross_attention", DECODERS)
def test_incremental_decoding_with_cache_equals_full_forward(attention, cross_attention):
    model = translator(cross_attention, attention)
    src, src_mask = pad_batch([random_ids(model.cfg, 20), random_ids(model.cfg, 9)])
    tgt = random_ids(model.cfg, 2, 10)
    with torch.no_grad():
        full = model(src, src_mask, tgt)
        cross = model.encode(src, src_mask)
        past, steps = None, []
        for t in range(tgt.shape[1]):
            logits, past = model.decode(tgt[:, t : t + 1], cross, past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention,cross_attention", DECODERS)
def test_translation_is_invariant_to_source_padding(attention, cross_attention):
    model = translator(cross_attention, attention)
    short, long = random_ids(model.cfg, 9), random_ids(model.cfg, 40)
    src, src_mask = pad_batch([short, long])
    tgt = random_ids(model.cfg, 2, 7)
    with torch.no_grad():
        batched = model(src, src_mask, tgt)
        alone = model(short[None], torch.ones(1, 9, dtype=torch.long), tgt[:1])
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)


def test_mean_pooling_compresses_the_layer_input_first_with_the_same_numbers(monkeypatch):
    cfg = small(projection="mean", sharing="layerwise")
    model = Classifier(cfg).eval()
    ids, mask = pad_batch([random_ids(cfg, 13), random_ids(cfg, 57)])
    with torch.no_grad():
        input_first = model(ids, mask)
        for projection in model.encoder.projections:
            monkeypatch.setattr(projection, "input_first", False)  # pool each head's keys and values instead
        per_head = model(ids, mask)
    torch.testing.assert_close(input_first, per_head, atol=1e-5, rtol=1e-5)
