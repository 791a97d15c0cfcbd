"""Checkpoint -> translation bundle: encoder.onnx, decoder.onnx, tokenizer.model, config.json,
MODEL_CARD.md, manifest.json. The export is checked against PyTorch before it is written.

encoder.onnx   input_ids, attention_mask int64 (B, S)
               -> cross_key_i, cross_value_i float (B, H, S', hd) for each decoder layer i (already projected,
                  and compressed to S' = k_cross rows for Linformer cross-attention), cross_mask bool (B, S').
               Run once per source.
decoder.onnx   as exported from PyTorch (the torch form): input_ids int64 (B, T), past_key_i, past_value_i
               (B, H, P, hd), cross_key_i, cross_value_i, cross_mask -> logits (B, T, V), present_key_i,
               present_value_i (B, H, P + T, hd). Checked against PyTorch (cached steps and a whole prefix), then
               rewritten in the step form the service runs (export/step_decoder.py: one token per row, the cache
               in buffers the runtime owns, rows of different lengths in one call) and checked against itself.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from export.bundle import versions, write_json, write_manifest
from export.card import translator_card
from export.fused import use_fused_attention
from export.step_decoder import convert_bundle, weights_of_model
from model import Translator
from training.batching import pad
from training.decode import greedy
from training.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from training.trainer import load_trained

OPSET = 17


def load_translator(checkpoint: Path) -> tuple[Translator, dict]:
    return load_trained(checkpoint, Translator)


def cache_names(prefix: str, n_layers: int) -> list[str]:
    """[prefix_key_0, prefix_value_0, prefix_key_1, ...]: the graph's per-layer key/value tensors."""
    return [f"{prefix}_{kind}_{i}" for i in range(n_layers) for kind in ("key", "value")]


class EncoderGraph(nn.Module):
    """Source -> every decoder layer's cross keys/values and the cross mask, flattened for ONNX."""

    def __init__(self, model: Translator):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        cross = self.model.encode(input_ids, attention_mask)
        flat = [t for keys, values, _ in cross for t in (keys, values)]
        return (*flat, cross[0][2][:, 0, 0, :])  # the mask is the same for every layer: (B, S')


class DecoderGraph(nn.Module):
    """One decoding call with the cache, flattened for ONNX: (ids, past..., cross..., mask) -> (logits, present...)."""

    def __init__(self, model: Translator):
        super().__init__()
        self.model = model
        self.n_layers = model.cfg.n_decoder_layers

    def forward(self, input_ids: torch.Tensor, *tensors: torch.Tensor):
        L = self.n_layers
        past_flat, cross_flat, cross_mask = tensors[: 2 * L], tensors[2 * L : 4 * L], tensors[4 * L]
        allowed = cross_mask[:, None, None, :]
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(L)]
        cross = [(cross_flat[2 * i], cross_flat[2 * i + 1], allowed) for i in range(L)]
        logits, presents = self.model.decode(input_ids, cross, past)
        return (logits, *[t for present in presents for t in present])


def export_onnx(model: Translator, out: Path) -> None:
    # The wrappers are built in eval mode: torch.onnx.export restores the wrapper's mode afterwards, and a
    # wrapper left in training mode would switch the model's dropout back on.
    encoder, decoder = EncoderGraph(model).eval(), DecoderGraph(model).eval()
    cfg = model.cfg
    L, H, hd = cfg.n_decoder_layers, cfg.n_heads, cfg.d_model // cfg.n_heads
    src = torch.randint(4, cfg.vocab_size, (2, 11))
    src_mask = torch.ones_like(src)
    src_mask[1, 7:] = 0
    cross_out = cache_names("cross", L)
    with torch.no_grad():
        with use_fused_attention(model):  # encoder self-attention as ORT's MultiHeadAttention kernel
            torch.onnx.export(
                encoder, (src, src_mask), out / "encoder.onnx", dynamo=False, opset_version=OPSET,
                input_names=["input_ids", "attention_mask"], output_names=[*cross_out, "cross_mask"],
                dynamic_axes={"input_ids": {0: "batch", 1: "source"}, "attention_mask": {0: "batch", 1: "source"},
                              **{name: {0: "batch", 2: "memory"} for name in cross_out},
                              "cross_mask": {0: "batch", 1: "memory"}},
            )  # fmt: skip
        cross = encoder(src, src_mask)
        # Traced with 3 cached positions and 2 new tokens, so neither length is baked in as a constant.
        past = [torch.randn(2, H, 3, hd) for _ in range(2 * L)]
        tgt = torch.randint(4, cfg.vocab_size, (2, 2))
        past_in, present_out = cache_names("past", L), cache_names("present", L)
        # No constant folding: it would store the tied embedding twice (as itself for the lookup and transposed
        # for the output layer), +4 MB on disk; ONNX Runtime folds the transpose in memory when it loads.
        torch.onnx.export(
            decoder, (tgt, *past, *cross), out / "decoder.onnx", dynamo=False, opset_version=OPSET,
            do_constant_folding=False,
            input_names=["input_ids", *past_in, *cross_out, "cross_mask"],
            output_names=["logits", *present_out],
            dynamic_axes={"input_ids": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"},
                          **{name: {0: "batch", 2: "past"} for name in past_in},
                          **{name: {0: "batch", 2: "total"} for name in present_out},
                          **{name: {0: "batch", 2: "memory"} for name in cross_out},
                          "cross_mask": {0: "batch", 1: "memory"}},
        )  # fmt: skip


def sessions(bundle: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return tuple(
        ort.InferenceSession(str(bundle / name), sess_options=options, providers=["CPUExecutionProvider"])
        for name in ("encoder.onnx", "decoder.onnx")
    )


def empty_cache(n_layers: int, batch: int, n_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    return {name: np.zeros((batch, n_heads, 0, head_dim), np.float32) for name in cache_names("past", n_layers)}


@torch.no_grad()
def check_parity(model: Translator, bundle: Path, sources: list[list[int]], max_new_tokens: int, batch_size: int = 25):
    """ORT greedy decoding in lock-step with PyTorch's cached decoding, then compared with training.decode.greedy.

    At every step both take the same input tokens (ORT's choice), so the logits are compared position by
    position, with the cache; then ORT's greedy outputs must equal PyTorch's own greedy outputs exactly.
    Also compares one teacher-forced call with a long new segment and an empty cache (the T > 1 path).
    """
    cfg = model.cfg
    L, H, hd = cfg.n_decoder_layers, cfg.n_heads, cfg.d_model // cfg.n_heads
    encoder, decoder = sessions(bundle)
    cross_names = [*cache_names("cross", L), "cross_mask"]
    worst_step, worst_full, identical, steps = 0.0, 0.0, 0, 0
    for start in range(0, len(sources), batch_size):
        src_ids, src_mask = pad(sources[start : start + batch_size], PAD_ID)
        B = src_ids.shape[0]
        encoded = encoder.run(cross_names, {"input_ids": src_ids.numpy(), "attention_mask": src_mask.numpy()})
        cross_ort = dict(zip(cross_names, encoded, strict=True))
        cross_torch = model.encode(src_ids, src_mask)
        feeds = {**cross_ort, **empty_cache(L, B, H, hd)}
        past_torch, tokens = None, torch.full((B, 1), BOS_ID)
        outputs: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, dtype=bool)
        for _ in range(min(max_new_tokens, cfg.tgt_n_max)):
            logits, *presents = decoder.run(None, {**feeds, "input_ids": tokens.numpy()})
            expected, past_torch = model.decode(tokens, cross_torch, past_torch)
            worst_step = max(worst_step, float(np.abs(logits - expected.numpy()).max()))
            steps += 1
            next_tokens = logits[:, -1].argmax(-1)
            for row, token in enumerate(next_tokens):
                if not done[row] and token != EOS_ID:
                    outputs[row].append(int(token))
            done |= next_tokens == EOS_ID
            if done.all():
                break
            feeds.update(zip(cache_names("past", L), presents, strict=True))
            tokens = torch.from_numpy(next_tokens[:, None])
        reference = greedy(model, src_ids, src_mask, max_new_tokens)
        identical += sum(a == b for a, b in zip(outputs, reference, strict=True))
        # teacher forcing: the whole reference prefix in one call with an empty cache
        tgt_in, _ = pad([[BOS_ID] + r[: cfg.tgt_n_max - 1] for r in reference], PAD_ID)
        logits = decoder.run(["logits"], {**cross_ort, **empty_cache(L, B, H, hd), "input_ids": tgt_in.numpy()})[0]
        expected = model.decode(tgt_in, cross_torch)[0].numpy()
        worst_full = max(worst_full, float(np.abs(logits - expected).max()))
    return {
        "sentences": len(sources),
        "greedy_identical": identical,
        "max_abs_logit_diff_cached_steps": worst_step,
        "max_abs_logit_diff_full_prefix": worst_full,
        "decoder_calls_compared": steps,
        "max_new_tokens": max_new_tokens,
    }


def export_translator(
    checkpoint: Path, tokenizer: Path, out: Path, name: str, parity_sources: list[list[int]], max_new_tokens: int = 256,
    notes: list[str] | None = None,
) -> dict:
    """Export, check parity on `parity_sources` (token ids with EOS), write the bundle; raise if parity fails."""
    model, saved = load_translator(checkpoint)
    cfg = model.cfg
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        stale.unlink()
    with tempfile.TemporaryDirectory() as tmp:  # parity is checked before anything lands in `out`
        export_onnx(model, Path(tmp))
        parity = check_parity(model, Path(tmp), parity_sources, max_new_tokens)
        if (
            parity["greedy_identical"] != parity["sentences"]
            or parity["max_abs_logit_diff_cached_steps"] > 1e-4
            or parity["max_abs_logit_diff_full_prefix"] > 1e-4
        ):
            raise RuntimeError(f"exported graphs disagree with PyTorch: {parity}")
        for graph in ("encoder.onnx", "decoder.onnx"):
            shutil.copyfile(Path(tmp) / graph, out / graph)
    shutil.copyfile(tokenizer, out / "tokenizer.model")
    linformer = cfg.attention == "linformer"
    config = {
        "name": name,
        "task": "translate",
        "attention": cfg.attention,
        "n_max": cfg.n_max,
        "k": cfg.k if linformer else None,
        "k_cross": cfg.k_cross if cfg.cross_attention == "linformer" else None,
        "cross_attention": cfg.cross_attention,
        "sharing": cfg.sharing if linformer else None,
        "projection": cfg.projection if linformer else None,
        "tgt_n_max": cfg.tgt_n_max,
        "n_decoder_layers": cfg.n_decoder_layers,
        "n_heads": cfg.n_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "special_tokens": {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID},
        "add_bos": False,  # source = pieces + [EOS]; the decoder starts from BOS
        "add_eos": True,
        "onnx": {"encoder": "encoder.onnx", "decoder": "decoder.onnx"},
        "export": {
            "opset": OPSET,
            "exporter": "torch.onnx.export(dynamo=False)",
            "encoder_attention": "com.microsoft MultiHeadAttention (fused)",
            "decoder_attention": "MatMul/Softmax graph, self-attention key/value cache",
            "length_penalty_alpha": 0.6,
        },
        "model_config": saved["model_config"],
        "parity": parity,
        "versions": versions(),
    }
    write_json(out / "config.json", config)
    (out / "MODEL_CARD.md").write_text(translator_card(config, saved, checkpoint, notes))
    write_manifest(out)
    return convert_bundle(out, parity_sources, weights_of_model(model))  # the form the service runs
