"""Batched greedy and beam-search decoding for a Translator, with the decoder's key/value cache.

The source is encoded once; each step feeds only the newest token (the cache holds the rest). A
sentence that is finished leaves the batch: its rows are dropped from the cache and the cross keys,
so the batch shrinks as it decodes. Outputs are token ids without BOS and EOS.

Beam search follows fairseq: at each step the 2·beam best continuations are ranked; an EOS among the
first `beam` finishes a hypothesis, scored sum(log p) / lp(len) with GNMT's length penalty
lp = ((5 + len) / 6) ** alpha (len counts EOS); the best non-EOS continuations make the next beams.
A sentence is done once it has `beam` finished hypotheses; at the length limit its live beams finish
as they are. service/runtime.py implements the same two searches over ONNX Runtime.

Two options, off by default (the service has neither), for the evaluation to measure:
- `no_repeat_ngram` n > 0: a token that would repeat an n-gram already in the hypothesis gets probability 0;
- `max_lengths`: a length limit per sentence (e.g. from its source length, `length_limits`), under
  max_new_tokens, at which it stops as at max_new_tokens.
"""

from __future__ import annotations

import torch

from model import Translator
from training.tokenizer import BOS_ID, EOS_ID


def length_penalty(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


def length_limits(src_mask: torch.Tensor, ratio: float, extra: int) -> list[int]:
    """Per-sentence output limit ratio * source length + extra (source tokens, EOS included)."""
    return [int(ratio * n + extra) for n in src_mask.sum(dim=1).tolist()]


def banned_tokens(history: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in `history` (fairseq's no_repeat_ngram_size)."""
    if n <= 0 or len(history) < n - 1:
        return []
    prefix = tuple(history[len(history) - (n - 1) :]) if n > 1 else ()
    return [history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i : i + n - 1]) == prefix]


def _ban(logits: torch.Tensor, histories: list[list[int]], n: int) -> None:
    for row, history in enumerate(histories):
        banned = banned_tokens(history, n)
        if banned:
            logits[row, banned] = float("-inf")


def _select(cross: list[tuple], past: list[tuple] | None, rows: torch.Tensor):
    """Keep only `rows` (dim 0) of the cross keys/values/mask and of the self-attention cache."""
    cross = [tuple(t[rows] for t in layer) for layer in cross]
    past = None if past is None else [tuple(t[rows] for t in layer) for layer in past]
    return cross, past


@torch.no_grad()
def greedy(
    model: Translator,
    src_ids: torch.Tensor,
    src_mask: torch.Tensor,
    max_new_tokens: int,
    no_repeat_ngram: int = 0,
    max_lengths: list[int] | None = None,
) -> list[list[int]]:
    """src (B, S) -> B lists of token ids: argmax at each step until EOS or max_new_tokens."""
    model.eval()
    max_new_tokens = min(max_new_tokens, model.cfg.tgt_n_max)
    B = src_ids.shape[0]
    limits = [min(max_new_tokens, limit) for limit in (max_lengths or [max_new_tokens] * B)]
    cross = model.encode(src_ids, src_mask)
    outputs: list[list[int]] = [[] for _ in range(B)]
    live = torch.arange(B)  # sentence of each row still in the batch
    last = torch.full((B, 1), BOS_ID, dtype=torch.long)
    past = None
    for step in range(max_new_tokens):
        logits, past = model.decode(last, cross, past)
        step_logits = logits[:, -1]
        if no_repeat_ngram:
            _ban(step_logits, [outputs[row] for row in live.tolist()], no_repeat_ngram)
        next_tokens = step_logits.argmax(dim=-1)  # (b,)
        for row, token in zip(live.tolist(), next_tokens.tolist(), strict=True):
            if token != EOS_ID:
                outputs[row].append(token)
        at_limit = torch.tensor([step + 1 >= limits[row] for row in live.tolist()])
        going = (next_tokens != EOS_ID) & ~at_limit
        if step == max_new_tokens - 1 or not going.any():
            break
        if not going.all():
            keep = going.nonzero().squeeze(1)
            cross, past = _select(cross, past, keep)
            live, next_tokens = live[keep], next_tokens[keep]
        last = next_tokens[:, None]
    return outputs


@torch.no_grad()
def beam_search(
    model: Translator,
    src_ids: torch.Tensor,
    src_mask: torch.Tensor,
    beam_size: int,
    max_new_tokens: int,
    alpha: float = 0.6,
    no_repeat_ngram: int = 0,
    max_lengths: list[int] | None = None,
) -> list[list[int]]:
    """src (B, S) -> B lists of token ids: the best finished hypothesis of each sentence."""
    model.eval()
    max_new_tokens = min(max_new_tokens, model.cfg.tgt_n_max)
    B, beam = src_ids.shape[0], beam_size
    limits = [min(max_new_tokens, limit) for limit in (max_lengths or [max_new_tokens] * B)]
    cross = [tuple(t.repeat_interleave(beam, dim=0) for t in layer) for layer in model.encode(src_ids, src_mask)]
    live = list(range(B))  # sentence of each block of `beam` rows
    scores = torch.zeros(B, beam)
    scores[:, 1:] = float("-inf")  # all beams start as the same BOS: only the first may expand
    history = torch.zeros(B * beam, 0, dtype=torch.long)  # tokens of each row so far
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    last = torch.full((B * beam, 1), BOS_ID, dtype=torch.long)
    past = None
    for step in range(max_new_tokens):
        logits, past = model.decode(last, cross, past)
        logp = torch.log_softmax(logits[:, -1].float(), dim=-1)  # (b * beam, V)
        if no_repeat_ngram:
            _ban(logp, history.tolist(), no_repeat_ngram)
        vocab = logp.shape[-1]
        candidates = (scores[:, :, None] + logp.view(len(live), beam, vocab)).view(len(live), -1)
        top_scores, top_index = candidates.topk(2 * beam, dim=1)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()
        kept_blocks, next_rows, next_tokens, next_scores = [], [], [], []
        for block, sentence in enumerate(live):
            at_limit = step == limits[sentence] - 1
            chosen = []
            for rank, (score, index) in enumerate(zip(top_scores[block], top_index[block], strict=True)):
                source_beam, token = divmod(index, vocab)
                row = block * beam + source_beam
                if token == EOS_ID:
                    if rank < beam:
                        hypothesis = history[row].tolist()
                        finished[sentence].append((score / length_penalty(step + 1, alpha), hypothesis))
                elif len(chosen) < beam:
                    chosen.append((row, token, score))
            if at_limit:  # out of length: the live beams end here, as they are
                for row, token, score in chosen:
                    hypothesis = history[row].tolist() + [token]
                    finished[sentence].append((score / length_penalty(step + 1, alpha), hypothesis))
            if len(finished[sentence]) >= beam or at_limit or not chosen:
                continue
            kept_blocks.append(sentence)
            next_rows += [row for row, _, _ in chosen]
            next_tokens += [token for _, token, _ in chosen]
            next_scores += [score for _, _, score in chosen]
        if not kept_blocks:
            break
        rows = torch.tensor(next_rows)
        cross, past = _select(cross, past, rows)
        history = torch.cat([history[rows], torch.tensor(next_tokens)[:, None]], dim=1)
        scores = torch.tensor(next_scores).view(len(kept_blocks), beam)
        last = history[:, -1:]
        live = kept_blocks
    return [max(hypotheses, key=lambda h: h[0])[1] for hypotheses in finished]


def translate_ids(
    model: Translator,
    src_ids: torch.Tensor,
    src_mask: torch.Tensor,
    beam_size: int = 1,
    max_new_tokens: int = 256,
    alpha: float = 0.6,
    no_repeat_ngram: int = 0,
    max_lengths: list[int] | None = None,
) -> list[list[int]]:
    if beam_size == 1:
        return greedy(model, src_ids, src_mask, max_new_tokens, no_repeat_ngram, max_lengths)
    return beam_search(model, src_ids, src_mask, beam_size, max_new_tokens, alpha, no_repeat_ngram, max_lengths)
