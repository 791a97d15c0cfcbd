"""MODEL_CARD.md: data provenance, recipe, metrics and export parity, from what training recorded."""

from __future__ import annotations

import json
from pathlib import Path

GROUP_NAMES = {"accuracy_imdb": "IMDB", "accuracy_rotten_tomatoes": "Rotten Tomatoes",
               "accuracy_le32": "≤ 32 tokens", "accuracy_33to256": "33–256 tokens", "accuracy_gt256": "> 256 tokens"}


def pretraining_lines(init_from: dict | None) -> list[str]:
    """The pretraining a fine-tuned classifier started from: corpus, recipe, validation perplexity."""
    if not init_from:
        return ["## Pretraining", "- None: trained from scratch on the labelled data.", ""]
    run = Path(init_from["checkpoint"]).parent
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    if not summary:
        return ["## Pretraining", f"- Encoder initialised from `{init_from['checkpoint']}` (no summary found).", ""]
    cfg, train, data = summary["model_config"], summary["train_config"], summary.get("data_meta", {})
    sources = ", ".join(f"{name} {c['kept']:,} documents" for name, c in data.get("sources", {}).items())
    tokens = data.get("tokens", {})
    return [
        "## Pretraining (masked-language modelling, then this fine-tuning)",
        f"- Corpus (`python -m training.corpus`): {sources}; {tokens.get('train', 0):,} training tokens, "
        f"{tokens.get('dev', 0):,} validation tokens; every classification dev/test text and EN-DE dev/test "
        "sentence removed by construction; sha256 "
        + ", ".join(f"`{name}` {digest[:16]}…" for name, digest in data.get("sha256", {}).items()) + ".",
        f"- BERT-style masking ({summary.get('mask_prob', 0.15):.0%} of positions; 80/10/10 mask/random/keep) on "
        f"{summary.get('seq_len', '?')}-token sequences, n_max {cfg['n_max']}, {summary['steps']} steps of at most "
        f"{train['max_tokens']} tokens, peak lr {train['lr']}, {train['warmup_steps']} warm-up steps; "
        f"{summary['threads_per_process']} CPU thread(s), {summary['train_wall_s'] / 60:.1f} min.",
        f"- Command: `python -m training pretrain --attention {cfg['attention']}"
        + (f" --k {cfg['k']} --projection {cfg['projection']}" if cfg["attention"] == "linformer" else "")
        + f" --n-max {cfg['n_max']} --d-model {cfg['d_model']} --n-heads {cfg['n_heads']} --n-layers {cfg['n_layers']}"
        f" --d-ff {cfg['d_ff']} --seq-len {summary.get('seq_len')} --max-steps {train['max_steps']}"
        f" --lr {train['lr']} --warmup-steps {train['warmup_steps']} --max-tokens {train['max_tokens']}"
        f" --eval-every {train.get('eval_every', 0)} --threads {train['threads']} --out PRETRAINED`",
        f"- Validation MLM perplexity at the end: {summary['dev']['perplexity']:.1f} "
        f"(masked-token accuracy {summary['dev']['accuracy']:.3f}).",
        "",
    ]


def split_count(count: int | dict) -> str:
    """`1500`, `{"total": 1500, ...}` or per source `{"imdb": 1500, "rotten_tomatoes": 1000}` -> text."""
    if not isinstance(count, dict):
        return str(count)
    if "total" in count:
        return str(count["total"])
    return " + ".join(f"{n} {source}" for source, n in count.items())


def _command_tail(train: dict, extra: dict) -> str:
    """The end of a card's training command, shared by both tasks: checkpoint keeping, the start checkpoint, out."""
    keep = (f" --save-every {train['save_every']} --keep-checkpoints {train['keep_checkpoints']}"
            if train.get("keep_checkpoints") else "")  # fmt: skip
    start = f" --data {extra['data']} --init-from {extra['init_from']['checkpoint']}" if extra.get("init_from") else ""
    device = f" --device {train['device']}" if train.get("device", "cpu") != "cpu" else ""
    return keep + start + device + " --out RUN`"


def _averaged_weights(extra: dict) -> list[str]:
    if not extra.get("averaged_steps"):
        return []
    return [f"- Served weights: the average of the checkpoints at steps {extra['averaged_steps']} "
            "(`python -m training.average RUN`)."]  # fmt: skip


def classifier_card(config: dict, saved: dict, checkpoint: Path, note: str = "") -> str:
    extra = saved.get("extra", {})
    meta = extra.get("data_meta", {})
    summary_path = checkpoint.parent / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    cfg, train = saved["model_config"], saved["train_config"]
    init = cfg.get("projection_init", "random")
    projection = (
        f"{cfg['projection']} pooling over windows of n_max/k = {cfg['n_max'] // cfg['k']} positions"
        if cfg["projection"] in ("mean", "max")
        else f"{cfg['projection']} projection"
        + (" (initialised as mean pooling over n_max/k positions, then learned)" if init == "mean" else "")
    )
    if cfg["attention"] == "linformer":
        kind = f"Linformer, k={cfg['k']}, {cfg['sharing']} sharing, {projection}"
    elif cfg["attention"] == "performer":
        redraw = cfg.get("feature_redraw", 0)
        kind = (
            f"Performer (FAVOR+), M = {config['n_features']} positive orthogonal random features per head, "
            "drawn once at build time and stored in the graph"
            + (f", redrawn every {redraw} steps in training" if redraw else ", never redrawn")
        )
    else:
        kind = "vanilla Transformer (full softmax attention)"
    counts = meta.get("counts", {})
    with_rotten_tomatoes = meta.get("dataset") == "imdb+rotten_tomatoes"
    lines = [
        f"# {config['name']}",
        "",
        f"Sentiment classifier ({', '.join(config['labels'])}) for reviews"
        + (", long and short" if with_rotten_tomatoes else " (trained on long IMDB reviews only)")
        + f". Encoder: {kind}; n_max = {cfg['n_max']} tokens.",
        "",
        "## Data provenance",
        f"- Source: PyPI package `{meta.get('package', '?')}=={meta.get('package_version', '?')}`, "
        "rows with `source == \"imdb\"` (the 25k Maas et al. train reviews), `<br />` turned into spaces, "
        "exact duplicates removed"
        + (", and the 8.5k short Rotten Tomatoes sentences (`source == \"rotten_tomatoes\"`), split on their own."
           if with_rotten_tomatoes else "."),
        f"- Seeded split (seed {meta.get('seed', '?')}): "
        + ", ".join(f"{split} {split_count(c)}" for split, c in counts.items())
        + "; the test part was never trained on"
        + (" (IMDB's split is the same as the earlier models')." if with_rotten_tomatoes else "."),
        f"- Prepared by `python -m training.{'corpus' if with_rotten_tomatoes else 'imdb'}`; sha256: "
        + ", ".join(f"`{name}` {digest[:16]}…" for name, digest in meta.get("sha256", {}).items()),
        f"- Tokenizer: SentencePiece, vocabulary {cfg['vocab_size']}, trained on the "
        + ("pretraining corpus's training documents." if with_rotten_tomatoes else "training split only."),
        "",
    ]
    lines += pretraining_lines(extra.get("init_from"))
    lines += [
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
        + (f" --n-features {cfg['n_features']}" if cfg.get("n_features") else "")
        + (f" --feature-redraw {cfg['feature_redraw']}" if cfg.get("feature_redraw") else "")
        + (f" --projection {cfg['projection']}" if cfg.get("projection", "linear") != "linear" else "")
        + (f" --projection-init {init}" if init != "random" else "")
        + f" --n-max {cfg['n_max']} --d-model {cfg['d_model']} --n-heads {cfg['n_heads']}"
        f" --n-layers {cfg['n_layers']} --d-ff {cfg['d_ff']} --epochs {train['epochs']} --lr {train['lr']}"
        f" --warmup-steps {train['warmup_steps']} --max-tokens {train['max_tokens']}"
        f" --threads {train['threads']}"
        + _command_tail(train, extra),
        *_averaged_weights(extra),
    ]
    if summary:
        lines += [
            f"- Trained on {summary['processes']} process(es) x {summary['threads_per_process']} CPU thread(s) "
            f"of a 2-core machine; {summary['steps']} steps; wall time {summary['train_wall_s'] / 60:.1f} min."
            + (f" {note}" if note else ""),
            "",
            "## Metrics (best dev checkpoint)",
            "| split | accuracy | loss |",
            "|---|---|---|",
            f"| dev | {summary['dev']['accuracy']:.4f} | {summary['dev']['loss']:.4f} |",
            f"| test | {summary['test']['accuracy']:.4f} | {summary['test']['loss']:.4f} |",
        ]
        groups = [key for key in summary["test"] if key.startswith("accuracy_")]
        if groups:
            lines += ["", "Test accuracy per source and per length bucket (tokens as the model sees them):", "",
                      "| " + " | ".join(GROUP_NAMES.get(key, key) for key in groups) + " |",
                      "|" + "---|" * len(groups),
                      "| " + " | ".join(f"{summary['test'][key]:.4f}" for key in groups) + " |"]  # fmt: skip
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


SOURCE_NAMES = {
    "help": "LibreOffice help pages aligned by paragraph id",
    "ui": "LibreOffice UI strings",
    "ding": "Ding example sentences",
    "desc": "Debian package descriptions (DDTP, Translation-de/-en paired by Description-md5)",
    "gettext": "German gettext catalogs of common programs",
    "joined": "consecutive help/description training pairs joined into 100-250-token examples",
}
LIBREOFFICE_AND_DING = ("libreoffice-help-en-us", "libreoffice-help-de", "libreoffice-l10n-de", "trans-de-en")


def translation_data_lines(meta: dict, extra: dict) -> list[str]:
    """Where the training data came from (packages, index files, counts per source, hashes)."""
    packages = meta.get("package_versions", {})
    counts = meta.get("counts", {})
    train = counts.get("train", {})
    sources = [name for name in SOURCE_NAMES if isinstance(train, dict) and train.get(name)]
    lines = [
        "- Debian packages: " + ", ".join(f"`{name}` {packages[name]}" for name in LIBREOFFICE_AND_DING
                                          if name in packages)  # fmt: skip
        + (f"; German `.mo` catalogs of {len(packages) - len(LIBREOFFICE_AND_DING)} more packages (names and "
           "versions in the data's meta.json: `training.ende.GETTEXT_PACKAGES`)"
           if len(packages) > len(LIBREOFFICE_AND_DING) else ""),  # fmt: skip
    ]
    if meta.get("ddtp"):
        ddtp = meta["ddtp"]
        hashes = ", ".join(f"`{name}` sha256 {digest[:16]}…" for name, digest in ddtp["sha256"].items())
        lines.append(f"- DDTP index files of Debian bookworm main (Release date {ddtp['release_date']}): {hashes}")
    lines += [
        "- Training sources: " + "; ".join(f"{SOURCE_NAMES[name]} ({train[name]:,})" for name in sources) + ".",
        "- Cleaned, deduplicated, seeded split (seed "
        f"{meta.get('seed', '?')}): " + ", ".join(f"{split} {c.get('total', c) if isinstance(c, dict) else c}"
                                                  for split, c in counts.items())  # fmt: skip
        + "; dev comes from help and Ding, test from help, Ding"
        + (" and package descriptions of whole source packages held out of training" if "desc" in sources else "")
        + "; no side of a held-out pair appears in train.",
        f"- Training pairs dropped as longer than n_max/tgt_n_max: {extra.get('dropped_from_train', '?')}.",
        "- Prepared by `python -m training.ende`; sha256: "
        + ", ".join(f"`{name}` {digest[:16]}…" for name, digest in meta.get("sha256", {}).items()),
    ]
    tokenizer = meta.get("tokenizer", {})
    trained_on = ("the first data version's training split (help, UI strings, Ding), reused so that training "
                  "could continue from the served model" if tokenizer.get("reused") else "the training split only")
    lines.append(f"- Tokenizer: joint EN+DE SentencePiece unigram, vocabulary {tokenizer.get('vocab_size', '?')}, "
                 f"trained on {trained_on} (pad 0, unk 1, bos 2, eos 3).")  # fmt: skip
    return lines


def translator_card(config: dict, saved: dict, checkpoint: Path, notes: list[str] | None = None) -> str:
    extra = saved.get("extra", {})
    meta = extra.get("data_meta", {})
    run = checkpoint.parent
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    evaluations = [json.loads(p.read_text()) for p in sorted(run.glob("eval-test-beam*.json"))]
    cfg, train = saved["model_config"], saved["train_config"]
    if cfg["attention"] == "linformer":
        init = " initialised as mean pooling over n_max/k positions" if cfg.get("projection_init") == "mean" else ""
        full_cross = cfg.get("cross_attention") == "transformer"
        cross = ("full cross-attention over the source" if full_cross
                 else f"Linformer-compressed cross-attention (k_cross={cfg['k_cross']})")  # fmt: skip
        encoder = f"Linformer encoder (k={cfg['k']}, {cfg['sharing']} sharing, {cfg['projection']} projection{init})"
        kind = f"{encoder}, {cross}"
        flags = f" --k {cfg['k']} " + ("--cross-attention transformer" if full_cross else f"--k-cross {cfg['k_cross']}")
    else:
        kind = "vanilla Transformer (full softmax attention in the encoder and the cross-attention)"
        flags = ""
    budget = f"{train['max_steps']} steps" if train.get("max_steps") else f"{train['epochs']} epochs"
    lines = [
        f"# {config['name']}",
        "",
        f"English -> German translation. {kind}; causal decoder self-attention with a key/value cache. "
        f"Sources up to n_max = {cfg['n_max']} tokens (EOS included), translations up to "
        f"tgt_n_max = {cfg['tgt_n_max']} tokens.",
        "",
        "## Data provenance",
        *translation_data_lines(meta, extra),
        "",
        "## Model and recipe",
        f"- d_model {cfg['d_model']}, {cfg['n_layers']} encoder + {cfg['n_decoder_layers']} decoder layers, "
        f"{cfg['n_heads']} heads, d_ff {cfg['d_ff']}, dropout {cfg['dropout']}, pre-LayerNorm, sinusoidal "
        "positions, tied input/output embeddings.",
        f"- {summary['parameters']:,} parameters." if summary else "- parameters: see config.json",
        f"- Label-smoothed (0.1) cross-entropy; AdamW (betas 0.9/0.98, weight decay {train['weight_decay']}), peak "
        f"lr {train['lr']}, {train['warmup_steps']} warm-up steps then cosine decay, gradient clipping "
        f"{train['clip_norm']}, batches of at most {train['max_tokens']} padded tokens (bucketed by max(source, "
        f"target) length), {budget}, seed {train['seed']}; best checkpoint by dev perplexity.",
        f"- Command: `python -m training translate --attention {cfg['attention']}{flags}"
        + (" --projection-init mean" if cfg.get("projection_init") == "mean" else "")
        + f" --d-model {cfg['d_model']} --n-heads {cfg['n_heads']} --n-layers {cfg['n_layers']}"
        f" --n-decoder-layers {cfg['n_decoder_layers']} --d-ff {cfg['d_ff']} --epochs {train['epochs']}"
        + (f" --max-steps {train['max_steps']}" if train.get("max_steps") else "")
        + f" --lr {train['lr']} --warmup-steps {train['warmup_steps']} --max-tokens {train['max_tokens']}"
        f" --threads {train['threads']}"
        + _command_tail(train, extra),
        *_averaged_weights(extra),
    ]
    if summary:
        lines += [
            (f"- Trained on {summary['processes']} process(es) x {summary['threads_per_process']} CPU thread(s) of a "
             "2-core machine" if summary.get("device", "cpu") == "cpu" else f"- Trained on one {summary['device']}")
            + f"; {summary['steps']} steps; wall time {summary['train_wall_s'] / 60:.1f} min.",
            *(f"- {note}" for note in notes or []),
            "",
            "## Metrics",
            f"- Perplexity (reference tokens, EOS included): dev {summary['dev']['ppl']:.2f}, "
            f"test {summary['test']['ppl']:.2f}.",
        ]
    for ev in evaluations:
        lines.append(
            f"- Test ({ev['sentences']} pairs), beam {ev['beam_size']}: BLEU {ev['bleu']}, chrF {ev['chrf']} "
            f"(sacrebleu `{ev['bleu_signature']}`), PyTorch decode {ev['decode_s']} s "
            f"({ev['threads']} thread(s), batches of {ev['batch_size']})."
        )
    parity = config["parity"]
    lines += [
        "",
        "## Export",
        f"- ONNX opset {config['export']['opset']}: `encoder.onnx` (run once per source: cross keys/values of "
        "every decoder layer, already projected and compressed) and `decoder.onnx` (new tokens + self-attention "
        "cache + cross keys/values -> logits and the grown cache; the first step gets an empty cache), which is "
        "then rewritten in the step form the service runs (see *Decoder form* below).",
        f"- Parity on {parity['sentences']} test sentences: ONNX Runtime greedy output identical to PyTorch "
        f"greedy for {parity['greedy_identical']}/{parity['sentences']}; max |logit difference| "
        f"{parity['max_abs_logit_diff_cached_steps']:.2e} over {parity['decoder_calls_compared']} cached steps "
        f"and {parity['max_abs_logit_diff_full_prefix']:.2e} for whole-prefix calls.",
        f"- Inputs longer than n_max = {config['n_max']} tokens are an error (the service answers 413, or "
        "truncates on request).",
        f"- Versions: {config['versions']}.",
        "",
    ]
    return "\n".join(lines)
