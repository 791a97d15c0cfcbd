"""Linformer (Wang et al. 2020), Performer (Choromanski et al. 2020) and the vanilla Transformer they are
compared with, in one plain file.

Linformer head (paper eq. 7):  softmax(Q Wq (E K Wk)^T / sqrt(d)) (F V Wv),  E, F of shape k x n.
E and F are stored as k x n_max and sliced to the first n columns for an input of length n.

Two properties the public implementations get wrong and this file gets right:
- Padding is removed before projecting: padded rows are zeroed before E/F (and left out of pooling),
  so a sequence's output does not depend on how much padding its batch adds (dynamic batching needs
  that). fairseq never applies its key padding mask to the compressed attention.
- The decoder is causal by construction: ordinary masked self-attention with a key/value cache.
  Masking the n x k compressed matrix, as a popular causal variant does, leaks future tokens.

Performer head (FAVOR+):  D^-1 phi(Q) (phi(K)^T V),  D = diag(phi(Q) phi(K)^T 1),  with positive orthogonal
random features phi(x) = exp(W x - |x|^2/2) / sqrt(M), W (M x hd) block-orthogonal, drawn once at build time
and kept as a buffer (the state dict and the exported graph hold them). What public versions miss:
- Padded keys contribute nothing: phi(k) is zero at padding before the sums phi(K)^T V and phi(K)^T 1, and
  the keys' stabilising max is taken over real keys only (google-research's takes a padding mask and
  ignores it).
- The causal form is prefix sums written as plain ops (cumsum), exportable; its state (the running sums)
  is the decoder's cache, constant in length. No custom kernel, no future key in any stabiliser.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ATTENTIONS = ("linformer", "transformer", "performer")
CROSS_ATTENTIONS = ("linformer", "transformer")
SHARING = ("none", "headwise", "key-value", "layerwise")
PROJECTIONS = ("linear", "mean", "max", "conv")


@dataclass
class ModelConfig:
    vocab_size: int = 8000
    n_max: int = 4096  # fixed maximum input length n; longer inputs are an error, never truncated here
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    attention: str = "linformer"  # "linformer", "transformer" (vanilla) or "performer" (FAVOR+)
    k: int | list[int] = 128  # projected length, or one per encoder layer (non-uniform k)
    sharing: str = "layerwise"  # none | headwise | key-value | layerwise
    projection: str = "linear"  # linear (learned E, F) | mean | max pooling | conv (kernel = stride = n/k)
    projection_init: str = "random"  # linear E, F start random (fairseq) or as mean pooling ("mean")
    n_features: int = 0  # performer: random features M per head; 0 = d_head ln d_head, rounded up to whole blocks
    feature_redraw: int = 0  # performer: draw new features every this many training steps (0: never)
    pad_id: int = 0
    num_labels: int = 2  # classifier only
    # encoder-decoder (translation) only
    n_decoder_layers: int = 0
    tgt_n_max: int = 256  # longest target the decoder's positions cover
    cross_attention: str = "linformer"  # linformer: compress the encoder memory to k_cross rows
    k_cross: int = 32

    def __post_init__(self) -> None:
        assert self.attention in ATTENTIONS, self.attention
        assert self.sharing in SHARING, self.sharing
        assert self.projection in PROJECTIONS, self.projection
        assert self.projection_init in ("random", "mean"), self.projection_init
        assert self.cross_attention in CROSS_ATTENTIONS, self.cross_attention
        assert self.d_model % self.n_heads == 0
        ks = self.layer_ks()
        assert len(ks) == self.n_layers, "give one k per encoder layer"
        if self.sharing == "layerwise":
            assert len(set(ks)) == 1, "layerwise sharing uses one E for all layers, so one k"
        if self.projection != "linear":
            assert all(self.n_max % k == 0 for k in ks), "pooling/conv windows are n_max / k long"

    def features(self) -> int:
        """The Performer's M: as given, or d_head ln d_head (the paper's choice) rounded up to a multiple of
        d_head, so that every block of W is a full orthogonal basis."""
        if self.n_features:
            return self.n_features
        d_head = self.d_model // self.n_heads
        return math.ceil(d_head * math.log(d_head) / d_head) * d_head

    def layer_ks(self) -> list[int]:
        return list(self.k) if isinstance(self.k, (list, tuple)) else [self.k] * self.n_layers

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls(**json.loads(text))


# ----------------------------------------------------------------------------------------------------
# Low-rank projections (E and F)


class LowRankProjection(nn.Module):
    """Compresses keys or values along the sequence axis: (B, H, T, hd) -> (B, H, k, hd).

    `weight` has one matrix per head (no sharing) or one for all heads (shape[0] == 1). Pooling has
    no weights; conv is a strided convolution (kernel = stride = n_max/k) with one tap vector per head
    or shared, i.e. E with tied blocks.
    """

    def __init__(self, kind: str, k: int, n_max: int, n_heads: int, init: str = "random"):
        super().__init__()
        self.kind, self.k, self.window = kind, k, n_max // k
        self.num_matrices = 0 if kind in ("mean", "max") else n_heads  # distinct k x n matrices held
        # linear in X and the same for every head: can compress the layer input (SelfAttention)
        self.input_first = kind == "mean" or (kind == "linear" and n_heads == 1)
        if kind == "linear" and init == "mean":  # row i averages positions [i n/k, (i+1) n/k): still fully learned
            e = windows(k, n_max)
            self.weight = nn.Parameter((e / e.sum(dim=1, keepdim=True)).repeat(n_heads, 1, 1))
        elif kind == "linear":  # fairseq's xavier init with gain 1/sqrt(2) has this std
            self.weight = nn.Parameter(torch.randn(n_heads, k, n_max) / math.sqrt(n_max + k))
        elif kind == "conv":  # starts as mean pooling
            self.weight = nn.Parameter(torch.full((n_heads, self.window), 1.0 / self.window))
        else:
            self.weight = None
        if kind == "mean":  # pooling as a matrix product: exports as one MatMul, any length
            self.register_buffer("blocks", windows(k, n_max), persistent=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, H, T, hd), keep (B, T) bool -> compressed (B, H, k', hd) and which of the k' rows are
        real (B, k') or None when all are. Padded rows are zeroed first, so they contribute nothing."""
        B, H, T, hd = x.shape
        x = x * keep[:, None, :, None].to(x.dtype)
        if self.kind == "linear":
            return self.weight[:, :, :T].unsqueeze(0) @ x, None  # (1, h, k, T) @ (B, H, T, hd)
        # Windows of n_max/k positions; a short input fills only the first ceil(T/window) of the k.
        r = self.window
        windows = -(-T // r)
        x = F.pad(x, (0, 0, 0, windows * r - T)).view(B, H, windows, r, hd)
        inside = F.pad(keep, (0, windows * r - T)).view(B, 1, windows, r, 1)
        valid = inside.any(dim=3).view(B, windows)  # a window holding only padding is masked out
        if self.kind == "mean":
            out = x.sum(dim=3) / inside.sum(dim=3).clamp(min=1).to(x.dtype)
        elif self.kind == "max":
            out = x.masked_fill(~inside, float("-inf")).amax(dim=3)
            out = out.masked_fill(~valid[:, None, :, None], 0.0)
        else:  # conv
            out = (x * self.weight.view(1, -1, 1, r, 1)).sum(dim=3)
        return out, valid

    def compress_input(self, x: torch.Tensor, keep: torch.Tensor):
        """For a linear E shared by all heads, or mean pooling: E X on the layer input (B, T, C) -> (B, k', C),
        the weight each compressed row gives the projection's bias (B, k', 1), and which rows are real
        (B, k') or None when all are. Both are linear, so E (X Wk + b) = (E X) Wk + (E keep) b."""
        T = x.shape[1]
        keep = keep.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
        if self.kind == "mean":  # window sums over real tokens / their count; an empty window is masked
            blocks = self.blocks[:, :T]  # (k, T)
            count = blocks @ keep  # (B, k, 1)
            valid = count > 0
            return (blocks @ (x * keep)) / count.clamp(min=1), valid.to(x.dtype), valid.squeeze(-1)
        e = self.weight[0, :, :T]  # (k, T)
        return e @ (x * keep), e @ keep, None


def windows(k: int, n_max: int) -> torch.Tensor:
    """(k, n_max) 0/1: row i covers positions [i n_max/k, (i+1) n_max/k)."""
    return (torch.arange(n_max)[None, :] * k // n_max == torch.arange(k)[:, None]).float()


def build_projections(cfg: ModelConfig, ks: list[int]) -> tuple[nn.ModuleList, list[tuple[int, int]]]:
    """The distinct E/F modules for a stack of layers, and for each layer the indices of its (E, F).

    Sharing levels (paper section 4): none = per layer, per head, separate E and F; headwise = per
    layer, one E and one F for all heads; key-value = per layer, E = F; layerwise = one E everywhere.
    """
    heads = cfg.n_heads if cfg.sharing == "none" else 1
    modules, plan = [], []
    for k in ks:
        if cfg.sharing == "layerwise" and modules:
            plan.append((0, 0))
            continue
        modules.append(LowRankProjection(cfg.projection, k, cfg.n_max, heads, cfg.projection_init))
        if cfg.sharing in ("key-value", "layerwise"):
            plan.append((len(modules) - 1,) * 2)
        else:
            modules.append(LowRankProjection(cfg.projection, k, cfg.n_max, heads, cfg.projection_init))
            plan.append((len(modules) - 2, len(modules) - 1))
    return nn.ModuleList(modules), plan


def projection_pair(projections: nn.ModuleList, pair: tuple) -> tuple:
    """A layer's (E, F) modules from its plan entry; (None, None) for vanilla attention."""
    return tuple(None if i is None else projections[i] for i in pair)


# ----------------------------------------------------------------------------------------------------
# Attention


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, C) -> (B, H, T, hd)"""
    B, T, C = x.shape
    return x.view(B, T, n_heads, C // n_heads).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, hd) -> (B, T, C)"""
    B, H, T, hd = y.shape
    return y.transpose(1, 2).reshape(B, T, H * hd)


def multihead_attention(q, k, v, key_mask: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """q (B, T, C), k and v (B, S, C), key_mask (B, S) bool or None -> (B, T, C)."""
    allowed = None if key_mask is None else key_mask[:, None, None, :]
    y = attend(split_heads(q, n_heads), split_heads(k, n_heads), split_heads(v, n_heads), allowed)
    return merge_heads(y)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v over (B, H, ., hd); `allowed` is a bool mask broadcast to the scores."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class HeadedAttention(nn.Module):
    """Query, key, value and output projections shared by the three attention kinds below."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q, self.k, self.v, self.out = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return split_heads(x, self.n_heads)


class SelfAttention(HeadedAttention):
    """Encoder self-attention: vanilla when no projections are given, Linformer otherwise.

    `fused`, when set (export does), replaces the attention core by a fused kernel with the same
    contract: (q (B, T, C), k and v (B, S, C), key_mask (B, S) bool or None, n_heads) -> (B, T, C).
    """

    fused = None

    def forward(self, x, keep, e: LowRankProjection | None = None, f: LowRankProjection | None = None):
        if e is None:  # vanilla: every real key, padding masked
            k, v, key_mask = self.k(x), self.v(x), keep
        elif e.input_first and f.input_first:
            # E (X Wk + b) = (E X) Wk + (E keep) b: compress the layer input to k rows first, then
            # apply Wk and Wv to k rows instead of T. Same numbers, ~4·T·C² fewer FLOPs per layer.
            xe, we, key_mask = e.compress_input(x, keep)
            xf, wf, _ = (xe, we, key_mask) if f is e else f.compress_input(x, keep)
            k = F.linear(xe, self.k.weight) + we * self.k.bias  # (B, k, C)
            v = F.linear(xf, self.v.weight) + wf * self.v.bias
        else:  # per-head E/F, pooling or conv: compress each head's keys and values
            k, key_mask = e(self.heads(self.k(x)), keep)
            v, _ = f(self.heads(self.v(x)), keep)
            k, v = merge_heads(k), merge_heads(v)
        attention = self.fused or multihead_attention
        return self.out(attention(self.q(x), k, v, key_mask, self.n_heads))


class CausalSelfAttention(HeadedAttention):
    """Decoder self-attention, causal by construction: query t sees keys 0..t, with a key/value cache."""

    def forward(self, x, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        T = x.shape[1]
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        P = k.shape[2] - T  # cached positions
        allowed = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(diagonal=P)
        y = attend(q, k, v, allowed)
        return self.out(merge_heads(y)), (k, v)


class CrossAttention(HeadedAttention):
    """Decoder attention over the encoder memory; keys/values are computed once per source."""

    def memory_kv(self, memory, keep, e: LowRankProjection | None = None, f: LowRankProjection | None = None):
        """-> keys (B, H, S', hd), values, and a bool mask broadcastable to the scores."""
        k, v = self.heads(self.k(memory)), self.heads(self.v(memory))
        if e is None:
            return k, v, keep[:, None, None, :]
        k, valid = e(k, keep)
        v, _ = f(v, keep)
        if valid is None:  # all k rows are real: give ONNX a concrete all-true mask
            valid = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
        return k, v, valid[:, None, None, :]

    def forward(self, x, k, v, allowed):
        y = attend(self.heads(self.q(x)), k, v, allowed)
        return self.out(merge_heads(y))


# ----------------------------------------------------------------------------------------------------
# Performer (FAVOR+)


def orthogonal_gaussian(m: int, d: int) -> torch.Tensor:
    """(m, d) rows with the marginals of N(0, I_d) but exactly orthogonal within each block of d rows:
    a random orthonormal basis per block (QR of a Gaussian), each row scaled by an independent chi_d norm
    (Choromanski et al. 2020, section 3; keeps the softmax-kernel estimate unbiased with lower variance)."""
    blocks = [torch.linalg.qr(torch.randn(d, d))[0].T for _ in range(math.ceil(m / d))]
    w = torch.cat(blocks)[:m]  # (m, d), unit rows
    return w * torch.randn(m, d).norm(dim=1, keepdim=True)


class RandomFeatures(nn.Module):
    """phi(x) = exp(w.x - |x|^2/2) / sqrt(M) for queries and keys, up to factors that D^-1 cancels.

    W (M, hd) is a buffer: in the state dict and a constant of the exported graph; redrawn in training only,
    if asked. Inputs are the heads' q and k; the hd^-1/4 that makes phi(q).phi(k) estimate exp(q.k / sqrt(hd))
    is folded into W. Each exp has a max subtracted first (the stable form): a factor per query, or one per
    sequence and head for the keys, both of which cancel in D^-1 phi(Q) (phi(K)^T V).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_head, self.m = cfg.d_model // cfg.n_heads, cfg.features()
        self.register_buffer("weight", orthogonal_gaussian(self.m, self.d_head))  # (M, hd), in the state dict
        self.scale = self.d_head**-0.25  # on q and k each: q.k / sqrt(hd)
        self.redraw_every, self.training_steps = cfg.feature_redraw, 0

    def redraw_if_due(self) -> None:
        """Called once per training forward pass: fresh features every `redraw_every` steps."""
        if not (self.training and self.redraw_every):
            return
        self.training_steps += 1
        if self.training_steps % self.redraw_every == 0:
            self.weight.copy_(orthogonal_gaussian(self.m, self.d_head))

    def projections(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, hd) -> w.x' (B, H, T, M), x' = x hd^-1/4."""
        return x @ (self.weight.T * self.scale)

    def half_norms(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, hd) -> |x'|^2/2 (B, H, T). No trailing axis of 1: ORT runs an elementwise op over
        (B, H, T, 1) one element per inner loop, several times slower than over (B, H, T)."""
        return x.square().sum(dim=-1) * (self.scale**2 / 2)

    def exponents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, H, T, hd) -> w.x' (B, H, T, M) and |x'|^2/2 (B, H, T, 1)."""
        return self.projections(x), self.half_norms(x).unsqueeze(-1)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """phi(q) times a factor per query (B, H, T, M): |q|^2/2 and 1/sqrt(M) are such factors, so
        exp(w.q') normalised over the features, a softmax over M, is phi(q) up to one: ORT's Softmax kernel
        subtracts the max over the features (the stable form) and exponentiates in one pass over (T, M)
        instead of three ops (max, subtract, exp). Each row sums to 1."""
        return torch.softmax(self.projections(q), dim=-1)

    def keys(self, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """phi(k) times one factor per sequence and head (B, H, T, M), zero at padding (keep (B, T) False).

        The max subtracted is over real keys only, so padding changes neither it nor any real key's
        features. The max, |k|^2/2 and padding all act on (B, H, T): one exp over (T, M), no mask on it."""
        a, half_norm = self.projections(k), self.half_norms(k)  # (B, H, T, M), (B, H, T)
        real = keep[:, None, :]
        peak = (a.amax(dim=-1) - half_norm).masked_fill(~real, float("-inf")).amax(dim=-1, keepdim=True)  # (B, H, 1)
        offset = (half_norm + peak.detach()).masked_fill(~real, float("inf"))  # exp(a - inf) = 0 at padding
        return torch.exp(a - offset.unsqueeze(-1))

    def causal_keys(self, k: torch.Tensor) -> torch.Tensor:
        """phi(k) times a constant of W (B, H, T, M), each <= 1. A max over the sequence would mix future
        keys into past positions and change with every new token; this bound needs none:
        w.x - |x|^2/2 = |w|^2/2 - |x - w|^2/2 <= |w|^2/2 for every input x."""
        a, half_norm = self.exponents(k)
        return torch.exp(a - half_norm - self.bound())

    def bound(self) -> torch.Tensor:
        return self.weight.square().sum(dim=1).max() / 2


class PerformerSelfAttention(HeadedAttention):
    """Encoder self-attention as FAVOR+: D^-1 phi(Q) (phi(K)^T V) in O(n M hd), padded keys left out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.features = RandomFeatures(cfg)

    def forward(self, x, keep, e=None, f=None):  # e, f: the encoder passes none for this kind
        self.features.redraw_if_due()
        B, T, C = x.shape
        q, k = self.heads(self.q(x)), self.heads(self.k(x))  # (B, H, T, hd)
        phi_q, phi_k = self.features.queries(q), self.features.keys(k, keep)  # (B, H, T, M)
        # V^T with a row of ones: one product gives (phi(K)^T V)^T and phi(K)^T 1. With phi(K) on the right,
        # ORT multiplies it as stored; phi(K)^T [V 1] made it transpose the (T, M) features per head, and its
        # hd + 1 = 33 output columns ran below speed. V^T costs the transpose V needs anyway.
        vt = self.v(x).view(B, T, self.n_heads, C // self.n_heads).permute(0, 2, 3, 1)  # (B, H, hd, T)
        s = torch.cat([vt, torch.ones_like(vt[:, :, :1])], dim=2) @ phi_k  # (B, H, hd + 1, M)
        # D^-1 phi(Q) (phi(K)^T V): numerator (B, H, T, hd) over the diagonal of D (B, H, T, 1)
        y = (phi_q @ s[:, :, :-1].transpose(2, 3)) / (phi_q @ s[:, :, -1].unsqueeze(-1))
        return self.out(merge_heads(y))


class CausalPerformerAttention(HeadedAttention):
    """Decoder self-attention as causal FAVOR+: query t sees the prefix sums over keys 0..t.

    The cache is the running state (sum of phi(k) v^T (B, H, M, hd), sum of phi(k) (B, H, M), positions
    seen (B,)): constant in length, the Performer's KV cache. Keys are stabilised by a bound fixed with W,
    not by a max over the sequence (RandomFeatures.causal_keys), so the incremental form is exact.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.features = RandomFeatures(cfg)

    def forward(self, x, past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        self.features.redraw_if_due()
        B, T, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))  # (B, H, T, hd)
        phi_q, phi_k = self.features.queries(q), self.features.causal_keys(k)  # (B, H, T, M)
        # prefix sums over s <= t: phi(k_s) v_s^T (B, H, T, M, hd) and phi(k_s) (B, H, T, M). T M hd floats
        # per head: fine at decoder lengths (tgt_n_max 256); decoding one token at a time holds only the state.
        kv = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)
        k_sum = torch.cumsum(phi_k, dim=2)
        seen = torch.full((B,), T, dtype=torch.long, device=x.device)
        if past is not None:  # continue the sums from the cached positions
            kv, k_sum = kv + past[0].unsqueeze(2), k_sum + past[1].unsqueeze(2)
            seen = seen + past[2]
        numerator = (phi_q.unsqueeze(-2) @ kv).squeeze(-2)  # (B, H, T, hd)
        y = numerator / (phi_q * k_sum).sum(dim=-1, keepdim=True)
        return self.out(merge_heads(y)), (kv[:, :, -1], k_sum[:, :, -1], seen)


# ----------------------------------------------------------------------------------------------------
# Blocks and models


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class EncoderBlock(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = PerformerSelfAttention(cfg) if cfg.attention == "performer" else SelfAttention(cfg)
        self.mlp, self.drop = MLP(cfg), nn.Dropout(cfg.dropout)

    def forward(self, x, keep, e=None, f=None):
        x = x + self.drop(self.attn(self.ln1(x), keep, e, f))
        return x + self.mlp(self.ln2(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.self_attn = CausalPerformerAttention(cfg) if cfg.attention == "performer" else CausalSelfAttention(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.mlp, self.drop = MLP(cfg), nn.Dropout(cfg.dropout)

    def forward(self, x, cross_kv, past=None):
        y, present = self.self_attn(self.ln1(x), past)
        x = x + self.drop(y)
        x = x + self.drop(self.cross_attn(self.ln2(x), *cross_kv))
        return x + self.mlp(self.ln3(x)), present


def sinusoids(n: int, d: int) -> torch.Tensor:
    """Fixed sine/cosine positions (Vaswani et al.): (n, d)."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = embed if embed is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer("pos", sinusoids(cfg.n_max, cfg.d_model), persistent=False)
        self.scale = math.sqrt(cfg.d_model)  # embeddings (std d^-1/2) scaled to the positions' size
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        if cfg.attention == "linformer":
            self.projections, self.plan = build_projections(cfg, cfg.layer_ks())
        else:
            self.projections, self.plan = nn.ModuleList(), [(None, None)] * cfg.n_layers
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """ids (B, T) int64, keep (B, T) bool (False at padding) -> (B, T, C)."""
        T = ids.shape[1]
        if not torch.jit.is_tracing() and not torch.compiler.is_compiling() and T > self.cfg.n_max:
            raise ValueError(f"input length {T} exceeds the model's n_max={self.cfg.n_max}")
        x = self.drop(self.embed(ids) * self.scale + self.pos[:T])
        for block, pair in zip(self.blocks, self.plan, strict=True):
            x = block(x, keep, *projection_pair(self.projections, pair))
        return self.ln_f(x)


class Classifier(nn.Module):
    """Encoder, mean over the real tokens, linear head: (B, T) -> logits (B, num_labels)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.d_model, cfg.num_labels)
        self.apply(init_weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask.bool()
        h = self.encoder(input_ids, keep)  # (B, T, C)
        w = keep.unsqueeze(-1).to(h.dtype)
        pooled = (h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)
        return self.head(self.drop(pooled))


class Translator(nn.Module):
    """Encoder-decoder with one joint vocabulary: embeddings and output layer are tied."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.n_decoder_layers > 0
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Encoder(cfg, self.embed)
        self.register_buffer("tgt_pos", sinusoids(cfg.tgt_n_max, cfg.d_model), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_decoder_layers))
        if cfg.cross_attention == "linformer":
            self.cross_projections, self.cross_plan = build_projections(
                cfg, [cfg.k_cross] * cfg.n_decoder_layers
            )
        else:
            self.cross_projections, self.cross_plan = nn.ModuleList(), [(None, None)] * cfg.n_decoder_layers
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(init_weights)

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[tuple]:
        """Source -> per decoder layer (keys, values, allowed): computed once per source."""
        keep = src_mask.bool()
        memory = self.encoder(src_ids, keep)
        return [
            block.cross_attn.memory_kv(memory, keep, *projection_pair(self.cross_projections, pair))
            for block, pair in zip(self.blocks, self.cross_plan, strict=True)
        ]

    def decode(self, tgt_ids: torch.Tensor, cross: list[tuple], past: list | None = None):
        """tgt_ids (B, T) continuing after the cached positions -> logits (B, T, V), new cache."""
        P = cached_positions(past)
        T = tgt_ids.shape[1]
        x = self.drop(self.embed(tgt_ids) * self.encoder.scale + self.tgt_pos[P : P + T])
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, cross[i], None if past is None else past[i])
            presents.append(present)
        return F.linear(self.ln_f(x), self.embed.weight), presents

    def forward(self, src_ids, src_mask, tgt_ids):
        return self.decode(tgt_ids, self.encode(src_ids, src_mask))[0]


def cached_positions(past: list | None) -> int:
    """Target positions already decoded: the key cache's length, or the count a Performer state keeps."""
    if past is None:
        return 0
    layer = past[0]
    return int(layer[2][0]) if len(layer) == 3 else layer[0].shape[2]


def init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):  # scaled by sqrt(d) in the forward pass, as in Vaswani et al.
        nn.init.normal_(module.weight, std=module.embedding_dim**-0.5)


def count_projection_matrices(model: nn.Module) -> int:
    """Distinct k x n projection matrices (pooling has none): the paper's sharing arithmetic."""
    return sum(m.num_matrices for m in model.modules() if isinstance(m, LowRankProjection))


class MaskedLM(nn.Module):
    """Encoder with a BERT-style prediction head tied to the input embeddings, for masked-language
    pretraining; a Classifier fine-tunes from its `encoder.*` weights (same names in both)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.transform, self.ln = nn.Linear(cfg.d_model, cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.apply(init_weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, predict_at: torch.Tensor | None = None):
        """-> logits (B, T, V), or (N, V) at the N positions where the bool mask `predict_at` (B, T) is set."""
        h = self.encoder(input_ids, attention_mask.bool())  # (B, T, C)
        if predict_at is not None:
            h = h[predict_at]  # (N, C): the vocabulary projection is the costly part, so only where it counts
        h = self.ln(F.gelu(self.transform(h)))
        return F.linear(h, self.encoder.embed.weight, self.bias)
