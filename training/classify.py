"""Sequence classification on the prepared IMDB data (training/imdb.py): the task the trainer runs."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import nn

from model import Classifier, ModelConfig
from training.batching import bucketed_batches, pad, to_device
from training.tokenizer import BOS_ID, PAD_ID

LABELS = ["negative", "positive"]
# Length buckets the issue tracker asks about (tokens as the model sees them, BOS included).
LENGTH_BUCKETS = {"le32": (0, 32), "33to256": (33, 256), "gt256": (257, 1 << 30)}


def read_split_with_source(path: Path) -> list[tuple[int, str, str]]:
    """(label, text, source); data prepared before Rotten Tomatoes joined has no source column: all IMDB."""
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [(int(row["label"]), row["text"], row.get("source") or "imdb") for row in rows]


def encode(sp: spm.SentencePieceProcessor, text: str, n_max: int) -> list[int]:
    """[BOS] + pieces, cut to n_max: the same tokenisation the service applies (bundle config add_bos)."""
    return ([BOS_ID] + sp.encode(text))[:n_max]


class ClassifyTask:
    def __init__(self, data_dir: Path, cfg: ModelConfig, eval_max_tokens: int = 16384):
        self.sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
        assert self.sp.get_piece_size() == cfg.vocab_size, "vocab_size must match the tokenizer"
        self.splits, self.sources = {}, {}
        for split in ("train", "dev", "test"):
            rows = read_split_with_source(data_dir / f"{split}.tsv")
            self.splits[split] = (
                [encode(self.sp, text, cfg.n_max) for _, text, _ in rows],
                [label for label, _, _ in rows],
            )
            self.sources[split] = [source for _, _, source in rows]
        self.model = Classifier(cfg)
        self.eval_max_tokens = eval_max_tokens

    def train_lengths(self) -> list[int]:
        return [len(ids) for ids in self.splits["train"][0]]

    def collate(self, indices: list[int], split: str = "train") -> dict[str, torch.Tensor]:
        seqs, labels = self.splits[split]
        ids, mask = pad([seqs[i] for i in indices], PAD_ID)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.tensor([labels[i] for i in indices]),
        }

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits, batch["labels"]), int(batch["attention_mask"].sum())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        model.eval()
        seqs, _ = self.splits[split]
        right, total_loss, device = torch.zeros(len(seqs), dtype=torch.bool), 0.0, next(model.parameters()).device
        for indices in bucketed_batches([len(s) for s in seqs], self.eval_max_tokens, 256):
            batch = to_device(self.collate(indices, split), device)
            logits = model(batch["input_ids"], batch["attention_mask"])
            total_loss += F.cross_entropy(logits, batch["labels"], reduction="sum").item()
            right[indices] = (logits.argmax(-1) == batch["labels"]).cpu()
        model.train()
        accuracy = right.float().mean().item()
        metrics = {"score": accuracy, "accuracy": accuracy, "loss": total_loss / len(seqs)}
        # per source and per length bucket, where the split has more than one of them
        sources = self.sources[split]
        groups = {f"accuracy_{source}": [s == source for s in sources] for source in sorted(set(sources))}
        for name, (low, high) in LENGTH_BUCKETS.items():
            groups[f"accuracy_{name}"] = [low <= len(s) <= high for s in seqs]
        for name, members in groups.items():
            chosen = torch.tensor(members)
            if 0 < int(chosen.sum()) < len(seqs):
                metrics[name] = right[chosen].float().mean().item()
        return metrics
