"""Length-bucketed batches under a padded-token budget, and padding.

Long reviews would blow memory in a fixed-size batch and short ones would waste compute on padding;
grouping similar lengths under a budget of batch_size x longest_length tokens fixes both.
"""

from __future__ import annotations

import random

import torch


def bucketed_batches(
    lengths: list[int], max_tokens: int, max_batch: int = 256, seed: int | None = None
) -> list[list[int]]:
    """Indices grouped into batches whose padded size (rows x longest) stays within max_tokens.

    With a seed, lengths are sorted inside random chunks (so batches are similar in length but the
    epoch differs from the last) and the batch order is shuffled; without one, the order is sorted.
    """
    order = list(range(len(lengths)))
    if seed is None:
        order.sort(key=lengths.__getitem__)
    else:
        rng = random.Random(seed)
        rng.shuffle(order)
        chunk = max_batch * 50
        order = [
            i
            for s in range(0, len(order), chunk)
            for i in sorted(order[s : s + chunk], key=lengths.__getitem__)
        ]
    batches, batch, longest = [], [], 0
    for i in order:
        grown = max(longest, lengths[i])
        if batch and (grown * (len(batch) + 1) > max_tokens or len(batch) == max_batch):
            batches.append(batch)
            batch, grown = [], lengths[i]
        batch.append(i)
        longest = grown
    if batch:
        batches.append(batch)
    if seed is not None:
        random.Random(seed + 1).shuffle(batches)
    return batches


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids (B, T) padded with pad_id at the right, and attention_mask (B, T) with 1 at real tokens."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A collated batch on the model's device (batches are built on the CPU)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
