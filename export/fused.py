"""ONNX Runtime's fused attention kernel for both attention kinds.

The exporter writes scaled_dot_product_attention as MatMul -> Softmax -> MatMul, and ORT's optimizer
does not fuse that back into its attention kernel (see ../shared/perf-notes.md). To compare Linformer
with the best vanilla baseline ORT has, both are exported with the `com.microsoft` MultiHeadAttention
contrib op: vanilla attends over all T keys with a key padding mask, Linformer over its k compressed
keys (no mask: every compressed row is real). The Performer's layers are not SelfAttention and are left
as they are: FAVOR+ is matrix products and exp, which export as plain ops.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from model.linformer import SelfAttention, multihead_attention


class FusedMultiHeadAttention(torch.autograd.Function):
    """Eager: the model's own attention. Exported: one com.microsoft MultiHeadAttention node."""

    @staticmethod
    def forward(ctx, q, k, v, key_mask, n_heads, hidden):  # noqa: ARG004
        return multihead_attention(q, k, v, key_mask, n_heads)

    @staticmethod
    def symbolic(g, q, k, v, key_mask, n_heads, hidden):
        bias = g.op("Constant", value_t=torch.zeros(3 * hidden))  # the Linear layers already added theirs
        inputs = [q, k, v, bias]
        if key_mask is not None and not key_mask.node().mustBeNone():
            inputs.append(g.op("Cast", key_mask, to_i=6))  # int32 (B, S): 1 = attend, 0 = padding
        out = g.op("com.microsoft::MultiHeadAttention", *inputs, num_heads_i=n_heads)
        out.setType(q.type())  # same shape and type as the query
        return out




@contextlib.contextmanager
def use_fused_attention(model: nn.Module) -> Iterator[None]:
    """Route every encoder self-attention of `model` through the fused kernel while exporting."""
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    for layer in layers:
        hidden = layer.q.out_features  # a Python int: the traced q.shape[-1] would be a graph value
        layer.fused = functools.partial(FusedMultiHeadAttention.apply, hidden=hidden)
    try:
        yield
    finally:
        for layer in layers:
            layer.fused = None
