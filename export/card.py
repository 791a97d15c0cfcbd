"""MODEL_CARD.md: data provenance, recipe, metrics and export parity, from what training recorded."""

from __future__ import annotations

import json
from pathlib import Path


def classifier_card(config: dict, saved: dict, checkpoint: Path) -> str:
    extra = saved.get("extra", {})
    meta = extra.get("data_meta", {})
    summary_path = checkpoint.parent / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    cfg, train = saved["model_config"], saved["train_config"]
    kind = (
        f"Linformer, k={cfg['k']}, {cfg['sharing']} sharing, {cfg['projection']} projection"
        if cfg["attention"] == "linformer"
        else "vanilla Transformer (full softmax attention)"
    )
    counts = meta.get("counts", {})
    lines = [
        f"# {config['name']}",
        "",
        f"IMDB sentiment classifier ({', '.join(config['labels'])}). Encoder: {kind}; n_max = {cfg['n_max']} tokens.",
        "",
        "## Data provenance",
        f"- Source: PyPI package `{meta.get('package', '?')}=={meta.get('package_version', '?')}`, "
        "rows with `source == \"imdb\"` (the 25k Maas et al. train reviews), `<br />` turned into spaces, "
        "exact duplicates removed.",
        f"- Seeded split (seed {meta.get('seed', '?')}): "
        + ", ".join(f"{split} {c.get('total', c) if isinstance(c, dict) else c}" for split, c in counts.items())
        + "; the test part was never trained on.",
        "- Prepared by `python -m training.imdb`; sha256: "
        + ", ".join(f"`{name}` {digest[:16]}…" for name, digest in meta.get("sha256", {}).items()),
        f"- Tokenizer: SentencePiece, vocabulary {cfg['vocab_size']}, trained on the training split only.",
        "",
        "## Model and recipe",
        f"- d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, d_ff {cfg['d_ff']}, "
        f"dropout {cfg['dropout']}, pre-LayerNorm, sinusoidal positions, mean over real tokens, linear head.",
        f"- {summary.get('parameters', '?'):,} parameters." if summary else "- parameters: see config.json",
        f"- AdamW (betas 0.9/0.98, weight decay {train['weight_decay']}), peak lr {train['lr']}, "
        f"{train['warmup_steps']} warm-up steps then cosine decay, gradient clipping {train['clip_norm']}, "
        f"length-bucketed batches of at most {train['max_tokens']} padded tokens, {train['epochs']} epochs, "
        f"seed {train['seed']}.",
        f"- Command: `python -m training classify --attention {cfg['attention']}"
        + (f" --k {cfg['k']} --sharing {cfg['sharing']}" if cfg["attention"] == "linformer" else "")
        + f" --n-max {cfg['n_max']} --d-model {cfg['d_model']} --n-heads {cfg['n_heads']}"
        f" --n-layers {cfg['n_layers']} --d-ff {cfg['d_ff']} --epochs {train['epochs']} --lr {train['lr']}"
        f" --warmup-steps {train['warmup_steps']} --max-tokens {train['max_tokens']}"
        f" --threads {train['threads']} --out RUN`",
    ]
    if summary:
        lines += [
            f"- Trained on {summary['processes']} process(es) x {summary['threads_per_process']} CPU thread(s) "
            f"of a 2-core machine; {summary['steps']} steps; wall time {summary['train_wall_s'] / 60:.1f} min.",
            "",
            "## Metrics (best dev checkpoint)",
            "| split | accuracy | loss |",
            "|---|---|---|",
            f"| dev | {summary['dev']['accuracy']:.4f} | {summary['dev']['loss']:.4f} |",
            f"| test | {summary['test']['accuracy']:.4f} | {summary['test']['loss']:.4f} |",
        ]
    parity = config["parity"]
    lines += [
        "",
        "## Export",
        f"- ONNX opset {config['export']['opset']}, optimised with {config['export']['optimizer']}; "
        f"fused operators: {config['export']['fused_operators']}.",
        f"- Parity at lengths {parity['lengths']}: max |ORT - PyTorch| = {parity['max_abs_diff_vs_torch']:.2e}; "
        f"max |padded batch - alone| = {parity['max_abs_diff_padded_vs_alone']:.2e}.",
        f"- Inputs longer than n_max = {config['n_max']} are an error (the service answers 413 or truncates "
        "on request).",
        f"- Versions: {config['versions']}.",
        "",
    ]
    return "\n".join(lines)
