"""Evaluate a translation checkpoint: BLEU and chrF (sacrebleu) of its decoded translations against the
references, perplexity on dev, and how long decoding took.

    python -m training translate-eval --checkpoint runs/translate-linformer-k64/best.pt --split test

Writes the result beside the checkpoint as eval-<split>-beam<N>.json and returns it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import sacrebleu
import torch

from model import ModelConfig
from training.batching import pad
from training.decode import translate_ids
from training.tokenizer import PAD_ID
from training.translate import TranslateTask


def load_task(checkpoint: Path, data: str | None = None) -> tuple[TranslateTask, dict]:
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    task = TranslateTask(Path(data or saved["extra"]["data"]), ModelConfig(**saved["model_config"]))
    task.model.load_state_dict(saved["model"])
    return task, saved


def translate_split(
    task: TranslateTask, split: str, beam_size: int, batch_size: int, max_new_tokens: int, limit: int = 0
) -> list[str]:
    """Detokenised translations of a split's sources, decoded in batches of similar length, in order."""
    sources = task.splits[split]["src"][: limit or None]
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    translations: list[str] = [""] * len(sources)
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        src_ids, src_mask = pad([sources[i] for i in indices], PAD_ID)
        outputs = translate_ids(task.model, src_ids, src_mask, beam_size, max_new_tokens)
        for i, ids in zip(indices, outputs, strict=True):
            translations[i] = task.sp.decode(ids)
    return translations


def evaluate_checkpoint(
    checkpoint: Path, split: str = "test", *, beam_size: int = 1, batch_size: int = 64, max_new_tokens: int = 256,
    threads: int = 0, data: str | None = None, limit: int = 0,
) -> dict:  # fmt: skip
    if threads:
        torch.set_num_threads(threads)
    task, saved = load_task(checkpoint, data)
    model = task.model.eval()
    dev = task.evaluate(model, "dev")
    started = time.perf_counter()
    hypotheses = translate_split(task, split, beam_size, batch_size, max_new_tokens, limit)
    decode_s = time.perf_counter() - started
    references = task.splits[split]["de"][: limit or None]
    bleu_metric, chrf_metric = sacrebleu.BLEU(), sacrebleu.CHRF()
    bleu = bleu_metric.corpus_score(hypotheses, [references])
    chrf = chrf_metric.corpus_score(hypotheses, [references])
    result = {
        "checkpoint": str(checkpoint),
        "split": split,
        "sentences": len(hypotheses),
        "beam_size": beam_size,
        "length_penalty_alpha": 0.6 if beam_size > 1 else None,
        "bleu": round(bleu.score, 2),
        "chrf": round(chrf.score, 2),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
        "dev_ppl": round(dev["ppl"], 3),
        "decode_s": round(decode_s, 2),
        "decode_ms_per_sentence": round(1000 * decode_s / len(hypotheses), 2),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "attention": saved["model_config"]["attention"],
        "examples": [{"en": task.splits[split]["en"][i], "de": references[i], "hypothesis": hypotheses[i]}
                     for i in range(min(5, len(hypotheses)))],
    }  # fmt: skip
    out = checkpoint.parent / f"eval-{split}-beam{beam_size}{f'-first{limit}' if limit else ''}.json"
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return result
