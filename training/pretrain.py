"""Masked-language-model pretraining on the English corpus (training/corpus.py): the task the trainer runs.

BERT's recipe at our scale: fixed-length sequences cut from the corpus's token stream (documents joined
by EOS), [BOS] first; 15 % of the other positions are predicted, of which 80 % are replaced by the mask
token, 10 % by a random token and 10 % left as they are. The tokenizer has no [MASK] piece, so the mask
token is <unk> (id 1), which the corpus's full-coverage tokenizer almost never emits on its own.

Validation masks are drawn once with a fixed seed, so every run and every step is scored on the same
masked tokens: perplexity curves of different attention kinds compare point by point (paper Figure 3).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model import MaskedLM, ModelConfig
from training.tokenizer import BOS_ID, UNK_ID

MASK_ID = UNK_ID
FIRST_REGULAR_ID = 4  # after pad, unk, bos, eos


def cut_sequences(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """A token stream -> (N, seq_len) int64 rows of [BOS] + seq_len - 1 consecutive tokens (the tail is dropped)."""
    body = seq_len - 1
    n = stream.size // body
    rows = torch.from_numpy(stream[: n * body].astype(np.int64)).view(n, body)
    return torch.cat([torch.full((n, 1), BOS_ID, dtype=torch.long), rows], dim=1)


def mask_tokens(
    ids: torch.Tensor, vocab_size: int, generator: torch.Generator, mask_prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (inputs with BERT's 80/10/10 corruption, bool (B, T) of the positions to predict). BOS is never chosen."""
    chosen = torch.rand(ids.shape, generator=generator) < mask_prob
    chosen[:, 0] = False
    action = torch.rand(ids.shape, generator=generator)
    inputs = ids.clone()
    inputs[chosen & (action < 0.8)] = MASK_ID
    randomised = chosen & (action >= 0.8) & (action < 0.9)
    inputs[randomised] = torch.randint(FIRST_REGULAR_ID, vocab_size, ids.shape, generator=generator)[randomised]
    return inputs, chosen


class PretrainTask:
    def __init__(
        self, data_dir: Path, cfg: ModelConfig, seq_len: int = 512, mask_prob: float = 0.15, seed: int = 1234,
        eval_sequences: int = 256,
    ):  # fmt: skip
        assert seq_len <= cfg.n_max, "sequences must fit the model's n_max"
        self.cfg, self.mask_prob = cfg, mask_prob
        self.train_rows = cut_sequences(np.load(data_dir / "train.ids.npy"), seq_len)
        dev_rows = cut_sequences(np.load(data_dir / "dev.ids.npy"), seq_len)[:eval_sequences]
        self.dev = mask_tokens(dev_rows, cfg.vocab_size, torch.Generator().manual_seed(seed), mask_prob)
        self.dev_labels = dev_rows
        self.generator = torch.Generator().manual_seed(seed + 1)  # training masks differ at every visit
        self.model = MaskedLM(cfg)

    def train_lengths(self) -> list[int]:
        return [self.train_rows.shape[1]] * self.train_rows.shape[0]

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        ids = self.train_rows[indices]
        inputs, predict_at = mask_tokens(ids, self.cfg.vocab_size, self.generator, self.mask_prob)
        return {"input_ids": inputs, "predict_at": predict_at, "labels": ids[predict_at]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs = batch["input_ids"]
        logits = model(inputs, torch.ones_like(inputs), batch["predict_at"])
        return F.cross_entropy(logits, batch["labels"]), inputs.numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int = 16) -> dict[str, float]:
        assert split in ("dev", "test"), split  # the corpus has one held-out split; test scores it too
        model.eval()
        device = next(model.parameters()).device
        inputs, predict_at = (t.to(device) for t in self.dev)
        dev_labels = self.dev_labels.to(device)
        total_loss, correct, count = 0.0, 0, 0
        for start in range(0, inputs.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            labels = dev_labels[rows][predict_at[rows]]
            logits = model(inputs[rows], torch.ones_like(inputs[rows]), predict_at[rows])
            total_loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == labels).sum())
            count += labels.numel()
        model.train()
        loss = total_loss / count
        return {"score": -loss, "loss": loss, "perplexity": math.exp(loss), "accuracy": correct / count}
