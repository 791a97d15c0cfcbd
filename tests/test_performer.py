"""The Performer (FAVOR+) attention: what it approximates, what padding and the future can't change, its
constant-size decoding state, and its ONNX export. Padding invariance of the whole classifier and the
decoder's causality are proven by the shared tests in test_model.py (the Performer is one of their cases)."""

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from model import Classifier, ModelConfig, Translator
from model.linformer import (
    CausalPerformerAttention,
    PerformerSelfAttention,
    RandomFeatures,
    SelfAttention,
    orthogonal_gaussian,
)

BASE = dict(vocab_size=50, n_max=64, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.0)


def performer(**overrides) -> ModelConfig:
    return ModelConfig(**{**BASE, "attention": "performer", **overrides})


def padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids, mask = torch.zeros(len(seqs), T, dtype=torch.long), torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


def test_default_feature_count_is_d_head_ln_d_head_in_whole_orthogonal_blocks():
    assert ModelConfig(d_model=128, n_heads=4).features() == 128  # d_head 32: 32 ln 32 = 110.9 -> 4 blocks of 32
    assert ModelConfig(d_model=256, n_heads=4).features() == 320  # d_head 64: 266.2 -> 5 blocks of 64
    assert ModelConfig(d_model=128, n_heads=4, n_features=100).features() == 100


def test_features_are_orthogonal_within_each_block_with_gaussian_norms():
    torch.manual_seed(0)
    d = 16
    w = orthogonal_gaussian(3 * d + 5, d)
    assert w.shape == (53, d)
    for start in range(0, 53, d):
        block = w[start : start + d]
        gram = block @ block.T
        torch.testing.assert_close(gram - torch.diag(gram.diagonal()), torch.zeros_like(gram), atol=1e-4, rtol=0)
    # row norms are chi_d: E|w|^2 = d, as for a Gaussian row (the estimator is unbiased only then)
    assert abs(orthogonal_gaussian(4096, d).square().sum(dim=1).mean().item() / d - 1) < 0.05


def test_output_approaches_softmax_attention_as_the_number_of_features_grows():
    """Same weights in a vanilla and a Performer layer; the relative error, averaged over five draws of W,
    measured at five M: it must shrink at every step (Monte Carlo: ~1/sqrt(M))."""
    torch.manual_seed(0)
    vanilla = SelfAttention(ModelConfig(**{**BASE, "attention": "transformer"}))
    with torch.no_grad():  # q.k / sqrt(hd) of order 0.5: attention neither uniform nor one-hot
        for linear in (vanilla.q, vanilla.k, vanilla.v):
            linear.weight.normal_(std=0.5 * BASE["d_model"] ** -0.5)
    x, keep = torch.randn(3, 40, BASE["d_model"]), torch.ones(3, 40, dtype=torch.bool)
    with torch.no_grad():
        exact = vanilla(x, keep)
    errors = {}
    for m in (16, 64, 256, 1024, 4096):
        draws = []
        for seed in range(5):
            torch.manual_seed(100 + seed)
            layer = PerformerSelfAttention(performer(n_features=m))
            missing, unexpected = layer.load_state_dict(vanilla.state_dict(), strict=False)
            assert missing == ["features.weight"] and not unexpected
            with torch.no_grad():
                draws.append(((layer(x, keep) - exact).abs().mean() / exact.abs().mean()).item())
        errors[m] = sum(draws) / len(draws)
    ms = list(errors)
    assert all(errors[a] > errors[b] for a, b in zip(ms, ms[1:], strict=False)), errors
    assert errors[4096] < errors[16] / 5 and errors[4096] < 0.06, errors


def test_padded_keys_contribute_nothing_even_where_they_would_set_the_max():
    """Padding whose keys are huge: a stabilising max taken over all keys (as public versions do) would be
    set by the padding and push every real key's features to underflow. Ours is taken over real keys."""
    cfg = performer()
    torch.manual_seed(0)
    model = Classifier(cfg).eval()
    with torch.no_grad():
        model.encoder.embed.weight[cfg.pad_id].mul_(300.0)
    short, long = torch.randint(4, 50, (13,)), torch.randint(4, 50, (57,))
    ids, mask = padded([short, long])
    with torch.no_grad():
        alone = model.encoder(short[None], torch.ones(1, 13, dtype=torch.bool))
        batched = model.encoder(ids, mask.bool())
        leaky = model.encoder(ids, torch.ones_like(mask, dtype=torch.bool))  # padding treated as real keys
    torch.testing.assert_close(batched[0, :13], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(batched).all()
    assert (leaky[0, :13] - alone[0]).abs().max() > 1e-3  # the check above can fail: padding does matter if summed


def definition(features: RandomFeatures, x: torch.Tensor) -> torch.Tensor:
    """phi(x) = exp(w.x' - |x'|^2/2) / sqrt(M), x' = x hd^-1/4, in float64 straight from the paper."""
    x = x.double() * features.d_head**-0.25
    w = features.weight.double()
    return torch.exp(x @ w.T - x.square().sum(-1, keepdim=True) / 2) / math.sqrt(features.m)


def test_features_are_the_papers_up_to_factors_that_d_inverse_cancels():
    """Queries: phi(q) times one factor per query. Keys: phi(k) times one factor per sequence and head,
    and exactly zero at padding. Any other factor would change the attention weights."""
    torch.manual_seed(0)
    features = RandomFeatures(performer())
    q, k = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 5:] = False
    ratio = features.queries(q).double() / definition(features, q)  # (B, H, T, M)
    torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-5, atol=0)
    phi_k = features.keys(k, keep).double()
    assert (phi_k[1, :, 5:] == 0).all()
    ratio = phi_k / definition(features, k)
    for b, n in ((0, 9), (1, 5)):
        real = ratio[b, :, :n]  # (H, n, M): one constant per head
        torch.testing.assert_close(real, real[:, :1, :1].expand_as(real), rtol=1e-5, atol=0)
    ratio = features.causal_keys(k).double() / definition(features, k)  # one constant of W for all
    torch.testing.assert_close(ratio, ratio.flatten()[:1].expand_as(ratio).reshape(ratio.shape), rtol=1e-5, atol=0)


def test_stabilised_features_stay_usable_where_the_plain_exp_underflows():
    torch.manual_seed(0)
    features = RandomFeatures(performer())
    q = torch.randn(1, 1, 4, 16) * 60  # exponents in the minus thousands: float32 exp gives 0 for every feature
    keep = torch.ones(1, 4, dtype=torch.bool)
    assert (definition(features, q).float().sum(dim=-1) == 0).all()  # D = 0: the plain form divides 0 by 0
    for phi in (features.queries(q), features.keys(q, keep), features.causal_keys(q / 10)):
        assert torch.isfinite(phi).all() and phi.max() <= 1.001  # 1 up to rounding of exponents in the hundreds
    torch.testing.assert_close(features.queries(q).sum(dim=-1), torch.ones(1, 1, 4))  # a softmax over the features


def test_encoder_attention_is_the_quadratic_form_over_real_keys():
    """D^-1 phi(Q) (phi(K)^T V), however the layer orders its products, equals the definition written
    out: weights phi(q_t).phi(k_s) over real keys s, rows normalised, times V; padded rows are zero in phi(K)."""
    torch.manual_seed(0)
    layer = PerformerSelfAttention(performer()).eval()
    x = torch.randn(2, 19, BASE["d_model"])
    keep = torch.ones(2, 19, dtype=torch.bool)
    keep[1, 11:] = False
    with torch.no_grad():
        y = layer(x, keep)
        q, k, v = layer.heads(layer.q(x)), layer.heads(layer.k(x)), layer.heads(layer.v(x))
        scores = layer.features.queries(q).double() @ layer.features.keys(k, keep).double().transpose(2, 3)
        assert (scores[1, :, :, 11:] == 0).all()
        weights = scores / scores.sum(dim=-1, keepdim=True)  # (B, H, T, T)
        reference = layer.out((weights.float() @ v).transpose(1, 2).reshape(2, 19, -1))
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)


def test_random_features_live_in_the_state_dict_and_fix_the_model():
    torch.manual_seed(1)
    first = Classifier(performer()).eval()
    torch.manual_seed(2)
    second = Classifier(performer()).eval()
    names = [name for name in first.state_dict() if name.endswith("features.weight")]
    assert len(names) == BASE["n_layers"]
    ids, mask = torch.randint(4, 50, (2, 30)), torch.ones(2, 30, dtype=torch.long)
    with torch.no_grad():
        assert not torch.allclose(first(ids, mask), second(ids, mask))
        second.load_state_dict(first.state_dict())  # strict: the features are part of what is loaded
        torch.testing.assert_close(second(ids, mask), first(ids, mask))


def test_features_are_redrawn_every_n_training_steps_and_never_in_eval():
    torch.manual_seed(0)
    model = Classifier(performer(feature_redraw=3))
    features = model.encoder.blocks[0].attn.features
    ids, mask = torch.randint(4, 50, (2, 10)), torch.ones(2, 10, dtype=torch.long)
    drawn = features.weight.clone()
    model.train()
    for _ in range(2):
        model(ids, mask)
    assert torch.equal(features.weight, drawn)
    model(ids, mask)  # third training step: new features
    assert not torch.equal(features.weight, drawn)
    model.eval()
    fixed = features.weight.clone()
    for _ in range(6):
        model(ids, mask)
    assert torch.equal(features.weight, fixed)


def causal_layer(seed: int = 0) -> CausalPerformerAttention:
    torch.manual_seed(seed)
    layer = CausalPerformerAttention(performer()).eval()
    with torch.no_grad():
        for linear in (layer.q, layer.k, layer.v):
            linear.weight.normal_(std=BASE["d_model"] ** -0.5)
    return layer


def test_causal_prefix_sums_equal_the_masked_quadratic_form():
    """cumsum form == (phi(Q) phi(K)^T masked to s <= t) V, row-normalised: the causal FAVOR+ definition."""
    layer = causal_layer()
    x = torch.randn(2, 17, BASE["d_model"])
    with torch.no_grad():
        y, _ = layer(x)
        q, k, v = layer.heads(layer.q(x)), layer.heads(layer.k(x)), layer.heads(layer.v(x))
        phi_q, phi_k = layer.features.queries(q), layer.features.causal_keys(k)
        scores = (phi_q @ phi_k.transpose(2, 3)).tril()  # (B, H, T, T), zero above the diagonal
        reference = layer.out(((scores @ v) / scores.sum(dim=-1, keepdim=True)).transpose(1, 2).reshape(2, 17, -1))
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)


def test_causal_state_is_constant_in_length_and_chunks_continue_exactly():
    layer = causal_layer()
    x = torch.randn(2, 20, BASE["d_model"])
    with torch.no_grad():
        full, _ = layer(x)
        y1, state = layer(x[:, :7])  # a prefix of 7, then chunks of 1, 5 and 7
        shapes = [tuple(t.shape) for t in state]
        outputs = [y1]
        for a, b in ((7, 8), (8, 13), (13, 20)):
            y, state = layer(x[:, a:b], state)
            outputs.append(y)
            assert [tuple(t.shape) for t in state] == shapes  # (B, H, M, hd), (B, H, M), (B,): no length axis
    assert state[2].tolist() == [20, 20]
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_causal_keys_are_stabilised_without_any_future_key():
    """A later key 50x larger must not change earlier outputs (a max over the whole sequence would)."""
    layer = causal_layer()
    x = torch.randn(1, 12, BASE["d_model"])
    loud = x.clone()
    loud[:, 8] *= 50.0
    with torch.no_grad():
        a, _ = layer(x)
        b, _ = layer(loud)
    assert torch.isfinite(b).all()
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=0, rtol=0)


def test_performer_translator_greedy_decoding_with_state_equals_recomputing_the_prefix():
    torch.manual_seed(0)
    cfg = performer(n_layers=1, n_decoder_layers=2, tgt_n_max=32, cross_attention="transformer")
    model = Translator(cfg).eval()
    src, src_mask = padded([torch.randint(4, 50, (20,)), torch.randint(4, 50, (9,))])
    tokens = torch.full((2, 1), 2)
    with torch.no_grad():
        cross = model.encode(src, src_mask)
        past = None
        for _ in range(8):
            logits, past = model.decode(tokens[:, -1:], cross, past)
            recomputed = model.decode(tokens, cross)[0][:, -1]
            torch.testing.assert_close(logits[:, -1], recomputed, atol=1e-5, rtol=1e-5)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)


class CausalStep(torch.nn.Module):
    """CausalPerformerAttention with its state as plain graph inputs and outputs, for ONNX."""

    def __init__(self, layer: CausalPerformerAttention):
        super().__init__()
        self.layer = layer

    def forward(self, x, kv, k_sum, seen):
        return self.layer(x, (kv, k_sum, seen))


def test_causal_performer_exports_to_onnx_with_its_state_as_inputs(tmp_path):
    layer = causal_layer()
    H, hd, M = BASE["n_heads"], BASE["d_model"] // BASE["n_heads"], performer().features()
    state = (torch.zeros(2, H, M, hd), torch.zeros(2, H, M), torch.zeros(2, dtype=torch.long))
    path = tmp_path / "causal.onnx"
    with torch.no_grad():
        torch.onnx.export(
            CausalStep(layer).eval(), (torch.randn(2, 3, BASE["d_model"]), *state), path, dynamo=False,
            opset_version=17, input_names=["x", "kv", "k_sum", "seen"],
            output_names=["y", "kv_out", "k_sum_out", "seen_out"],
            dynamic_axes={"x": {0: "batch", 1: "new"}, "y": {0: "batch", 1: "new"},
                          **{name: {0: "batch"} for name in ("kv", "k_sum", "seen", "kv_out", "k_sum_out",
                                                             "seen_out")}},
        )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 11, BASE["d_model"])
    with torch.no_grad():
        full, _ = layer(x)
    feeds = {"x": x[:, :6].numpy(), "kv": state[0].numpy(), "k_sum": state[1].numpy(), "seen": state[2].numpy()}
    first, kv, k_sum, seen = session.run(None, feeds)  # a 6-token prefix, then one token at a time
    outputs = [first]
    for t in range(6, 11):
        y, kv, k_sum, seen = session.run(None, {"x": x[:, t : t + 1].numpy(), "kv": kv, "k_sum": k_sum, "seen": seen})
        outputs.append(y)
    assert seen.tolist() == [11, 11]
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("m", [8, 128])
def test_exponent_bound_holds_for_any_input(m):
    torch.manual_seed(0)
    layer = CausalPerformerAttention(performer(n_features=m))
    scales = torch.tensor([0.1, 1.0, 10.0, 100.0])[:, None, None, None]
    x = torch.randn(4, 1, 50, BASE["d_model"] // BASE["n_heads"]) * scales
    a, half_norm = layer.features.exponents(x)
    assert (a - half_norm <= layer.features.bound() + 1e-4).all()
    assert math.isfinite(layer.features.bound().item())
