"""FLOPs of one encoder layer as our exported graphs compute it (2 FLOPs per multiply-add).

Counted: the matrix products (projections, attention, feed-forward). Left out, being O(n·d) or
O(n·k) and the same order for both kinds: biases, softmax, LayerNorm, GELU, residuals, E·mask.

Vanilla, per layer, n tokens, width d, feed-forward width d_ff:
    Q, K, V, output projections   4 · 2·n·d²     = 8·n·d²
    scores Q·Kᵀ and weights · V   2 · 2·n²·d     = 4·n²·d
    feed-forward                  2 · 2·n·d·d_ff = 4·n·d·d_ff       (16·n·d² at d_ff = 4d)

Linformer as model/linformer.py computes it with one shared linear E (layerwise sharing): the layer
input is compressed first, E·X, then Wk and Wv act on k rows, and E·X serves both K and V:
    Q, output projections         2 · 2·n·d²     = 4·n·d²
    E·X                           2·n·k·d
    K, V projections on k rows    2 · 2·k·d²     = 4·k·d²
    scores and weights · V        2 · 2·n·k·d    = 4·n·k·d
    feed-forward                  4·n·d·d_ff

The paper's order (project K = X·Wk on n rows, then E·K and F·V) costs 8·n·d² + 8·n·k·d + FFN.

Performer (FAVOR+) as model/linformer.py computes it, M random features per head, H heads of width d/H:
    Q, K, V, output projections   8·n·d²
    features W·q and W·k          2 · 2·n·d·M    = 4·n·d·M   (H heads × 2·n·(d/H)·M each)
    [V 1]ᵀ·φ(K)                   2·n·M·(d + H)              (Vᵀ with a row of ones per head: φ(K)ᵀV and φ(K)ᵀ1)
    φ(Q)·(φ(K)ᵀV), φ(Q)·φ(K)ᵀ1    2·n·M·(d + H)              (the numerator and the diagonal of D)
    feed-forward                  4·n·d·d_ff
Left out as for the others: the exp, the max and |x|²/2 of the features (O(n·M·H), like the softmax), and
the division by D (O(n·d)).
"""

from __future__ import annotations


def vanilla_layer_flops(n: int, d: int, d_ff: int) -> int:
    return 8 * n * d * d + 4 * n * n * d + 4 * n * d * d_ff


def linformer_layer_flops(n: int, d: int, d_ff: int, k: int, input_first: bool = True) -> int:
    """`input_first`: compress the layer input (E·X)·Wk, shared by K and V, as our model does;
    else the paper's E·(X·Wk) and F·(X·Wv), with K and V projected on all n rows."""
    ffn = 4 * n * d * d_ff
    if input_first:
        return 4 * n * d * d + 2 * n * k * d + 4 * k * d * d + 4 * n * k * d + ffn
    return 8 * n * d * d + 2 * 2 * n * k * d + 4 * n * k * d + ffn


def flop_ratio(n: int, d: int, d_ff: int, k: int, input_first: bool = True) -> float:
    """Vanilla FLOPs over Linformer FLOPs: the speedup a FLOP-bound kernel could reach at most."""
    return vanilla_layer_flops(n, d, d_ff) / linformer_layer_flops(n, d, d_ff, k, input_first)


def performer_layer_flops(n: int, d: int, d_ff: int, m: int, n_heads: int) -> int:
    return 8 * n * d * d + 4 * n * d * m + 4 * n * m * (d + n_heads) + 4 * n * d * d_ff


def performer_flop_ratio(n: int, d: int, d_ff: int, m: int, n_heads: int) -> float:
    """Vanilla FLOPs over Performer FLOPs: the speedup a FLOP-bound kernel could reach at most."""
    return vanilla_layer_flops(n, d, d_ff) / performer_layer_flops(n, d, d_ff, m, n_heads)
