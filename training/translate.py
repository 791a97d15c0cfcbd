"""EN->DE translation on the prepared data (training/ende.py): the task the trainer runs.

Source = pieces(en) + [EOS]; decoder input = [BOS] + pieces(de); decoder target = pieces(de) + [EOS].
The loss is label-smoothed cross-entropy over the real target tokens; the dev score is minus the
perplexity (exp of the unsmoothed token-level NLL), so the trainer keeps the lowest-perplexity model.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import nn

from model import ModelConfig, Translator
from training.batching import bucketed_batches, pad, to_device
from training.tokenizer import BOS_ID, EOS_ID, PAD_ID

LABEL_SMOOTHING = 0.1


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """(en, de) pairs of a prepared split (header `source<TAB>en<TAB>de`, no quoting)."""
    with open(path, encoding="utf-8", newline="") as f:
        return [(row["en"], row["de"]) for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def encode_source(sp: spm.SentencePieceProcessor, text: str, n_max: int) -> list[int]:
    """pieces + [EOS], the body cut so the whole fits n_max: what the service does with truncate=true."""
    return sp.encode(text)[: n_max - 1] + [EOS_ID]


class TranslateTask:
    def __init__(self, data_dir: Path, cfg: ModelConfig, eval_max_tokens: int = 8192):
        self.sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
        assert self.sp.get_piece_size() == cfg.vocab_size, "vocab_size must match the tokenizer"
        self.cfg = cfg
        self.splits: dict[str, dict[str, list]] = {}
        self.dropped_from_train = 0
        for split in ("train", "dev", "test"):
            pairs = read_pairs(data_dir / f"{split}.tsv")
            src = [self.sp.encode(en) + [EOS_ID] for en, _ in pairs]
            tgt = [self.sp.encode(de) for _, de in pairs]
            keep = [i for i in range(len(pairs)) if len(src[i]) <= cfg.n_max and len(tgt[i]) + 1 <= cfg.tgt_n_max]
            if split == "train":  # overlong training pairs are dropped (none are at n_max = tgt_n_max = 256)
                self.dropped_from_train = len(pairs) - len(keep)
            else:  # held-out pairs are never dropped: an overlong source is cut as the service would
                keep = list(range(len(pairs)))
                src = [encode_source(self.sp, en, cfg.n_max) for en, _ in pairs]
                tgt = [t[: cfg.tgt_n_max - 1] for t in tgt]
            self.splits[split] = {
                "src": [src[i] for i in keep],
                "tgt": [tgt[i] for i in keep],
                "en": [pairs[i][0] for i in keep],
                "de": [pairs[i][1] for i in keep],
            }
        self.model = Translator(cfg)
        self.eval_max_tokens = eval_max_tokens

    def lengths(self, split: str) -> list[int]:
        data = self.splits[split]
        return [max(len(s), len(t) + 1) for s, t in zip(data["src"], data["tgt"], strict=True)]

    def train_lengths(self) -> list[int]:
        return self.lengths("train")

    def collate(self, indices: list[int], split: str = "train") -> dict[str, torch.Tensor]:
        data = self.splits[split]
        src_ids, src_mask = pad([data["src"][i] for i in indices], PAD_ID)
        tgt_in, _ = pad([[BOS_ID] + data["tgt"][i] for i in indices], PAD_ID)
        tgt_out, _ = pad([data["tgt"][i] + [EOS_ID] for i in indices], PAD_ID)  # PAD never is a real target
        return {"src_ids": src_ids, "src_mask": src_mask, "tgt_in": tgt_in, "tgt_out": tgt_out}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        logits = model(batch["src_ids"], batch["src_mask"], batch["tgt_in"])  # (B, T, V)
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=PAD_ID, label_smoothing=LABEL_SMOOTHING
        )
        n_tokens = int(batch["src_mask"].sum()) + int((batch["tgt_out"] != PAD_ID).sum())
        return loss, n_tokens

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Perplexity of the reference translations: exp(mean NLL per target token, EOS included)."""
        model.eval()
        total_nll, total_tokens, device = 0.0, 0, next(model.parameters()).device
        for indices in bucketed_batches(self.lengths(split), self.eval_max_tokens, 256):
            batch = to_device(self.collate(indices, split), device)
            logits = model(batch["src_ids"], batch["src_mask"], batch["tgt_in"])
            total_nll += F.cross_entropy(
                logits.flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=PAD_ID, reduction="sum"
            ).item()
            total_tokens += int((batch["tgt_out"] != PAD_ID).sum())
        model.train()
        nll = total_nll / total_tokens
        ppl = math.exp(nll)
        return {"score": -ppl, "ppl": ppl, "nll": nll}
