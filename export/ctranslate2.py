"""A vanilla-Transformer translation bundle -> a CTranslate2 model with the same weights (the peer of issue #17).

The weights are read from the bundle's ONNX initializers, not from a checkpoint: the committed bundle is what we
serve, so the peer runs exactly those numbers. decoder.onnx (exported without constant folding) keeps every
parameter under its PyTorch name. encoder.onnx was constant-folded, so its Linear weights are stored transposed
under names like `onnx::MatMul_425`; each such MatMul feeds an Add of a named bias (`...attn.k.bias`), which
names the weight. The cross-attention keys/values are computed in the encoder graph, so their weights come from
there too.

How the model maps onto CTranslate2's `TransformerSpec` (ctranslate2.specs), and what was checked rather than
assumed:
- pre-LayerNorm blocks with a final LayerNorm in encoder and decoder (pre_norm=True); the epsilon is read from
  the graphs' LayerNormalization nodes;
- the feed-forward activation is exact (erf) GELU: Activation.GELU, not GELUTanh;
- embeddings are multiplied by sqrt(d_model) (the graph's Mul constant is checked) = CTranslate2's
  `scale_embeddings`; the sinusoidal tables are the graphs' own constants (sine at even, cosine at odd
  channels), set as explicit position encodings instead of CTranslate2's built-in table;
- one tied embedding for source, target and the output layer (no output bias);
- q/k/v of self-attention fused into one Linear, cross-attention k/v into another, as CTranslate2 expects;
- SentencePiece ids are the vocabulary order: pad 0 `<pad>`, unk 1 `<unk>`, bos 2 `<s>`, eos 3 `</s>`. The
  decoder starts from `<s>`; sources get `</s>` appended (add_source_eos), as our tokenizer does.

    python -m export ctranslate2 --bundle models/translate-transformer --out .cache/ct2/translate-transformer

The output directory is a CTranslate2 model (model.bin, config.json, shared_vocabulary.json) plus the bundle's
tokenizer.model; it is not a served bundle and is not committed (8 MB, made in seconds). int8 is chosen when
loading it (`compute_type="int8"`), as CTranslate2 users do.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

PIECES = {0: "<pad>", 1: "<unk>", 2: "<s>", 3: "</s>"}  # the ids the bundle's config.json promises


def graph_weights(path: Path, prefix: str = "model.") -> dict[str, np.ndarray]:
    """Parameters of one exported graph under their PyTorch names (without `prefix`), Linear weights as (out, in).

    Named initializers are taken as they are; an unnamed MatMul weight (constant folding stored it transposed)
    takes the name of the bias added to its output."""
    graph = onnx.load(str(path)).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    weights = {name.removeprefix(prefix): value for name, value in arrays.items() if name.startswith(prefix)}
    for node in graph.node:
        folded = [name for name in node.input if name in arrays and not name.startswith(prefix)]
        if node.op_type != "MatMul" or not folded:
            continue
        biases = [name for add in consumers.get(node.output[0], []) if add.op_type == "Add"
                  for name in add.input if name.endswith(".bias") and name in arrays]  # fmt: skip
        if len(biases) != 1:
            raise ValueError(f"{path}: cannot name the weight {folded[0]} (MatMul {node.name} feeds {biases})")
        weights[biases[0].removeprefix(prefix).removesuffix(".bias") + ".weight"] = arrays[folded[0]].T
    return weights


def graph_facts(path: Path, d_model: int) -> dict:
    """What the graph computes beyond its weights: LayerNorm epsilon, the embedding scale, the position table."""
    graph = onnx.load(str(path)).graph
    epsilons = {attr.f for node in graph.node if node.op_type == "LayerNormalization"
                for attr in node.attribute if attr.name == "epsilon"}  # fmt: skip
    constants = [numpy_helper.to_array(attr.t) for node in graph.node if node.op_type == "Constant"
                 for attr in node.attribute if attr.name == "value"]  # fmt: skip
    tables = [c for c in constants if c.ndim == 2 and c.shape[1] == d_model and c.dtype == np.float32]
    scales = [float(c) for c in constants if c.ndim == 0 and c.dtype == np.float32]
    if len(epsilons) != 1 or len(tables) != 1:
        raise ValueError(f"{path}: expected one LayerNorm epsilon and one position table, got {epsilons}, "
                         f"{[t.shape for t in tables]}")  # fmt: skip
    if not any(math.isclose(s, math.sqrt(d_model), rel_tol=1e-6) for s in scales):
        raise ValueError(f"{path}: no embedding scale sqrt({d_model}) among the graph's constants")
    return {"layer_norm_epsilon": epsilons.pop(), "positions": tables[0]}


def transformer_spec(bundle: Path):
    """The bundle's weights in a ctranslate2.specs.TransformerSpec (not yet optimised or saved)."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = json.loads((bundle / "config.json").read_text())
    cfg = config["model_config"]
    if cfg["attention"] != "transformer" or cfg["cross_attention"] != "transformer":
        raise ValueError(f"{bundle}: CTranslate2 runs vanilla attention only (this bundle: {cfg['attention']}, "
                         f"cross {cfg['cross_attention']})")  # fmt: skip
    specials = config["special_tokens"]
    if [specials["pad_id"], specials["unk_id"], specials["bos_id"], specials["eos_id"]] != [0, 1, 2, 3]:
        raise ValueError(f"{bundle}: special token ids {specials} are not pad 0, unk 1, bos 2, eos 3")
    d = cfg["d_model"]
    weights = {**graph_weights(bundle / "encoder.onnx"), **graph_weights(bundle / "decoder.onnx")}
    encoder_facts, decoder_facts = graph_facts(bundle / "encoder.onnx", d), graph_facts(bundle / "decoder.onnx", d)
    if encoder_facts["layer_norm_epsilon"] != decoder_facts["layer_norm_epsilon"]:
        raise ValueError("encoder and decoder LayerNorm epsilons differ")

    def linear(spec, *names: str) -> None:  # several names: fused along the output dimension (q;k;v)
        spec.weight = np.concatenate([weights.pop(f"{name}.weight") for name in names])
        spec.bias = np.concatenate([weights.pop(f"{name}.bias") for name in names])

    def layer_norm(spec, name: str) -> None:
        spec.gamma, spec.beta = weights.pop(f"{name}.weight"), weights.pop(f"{name}.bias")

    gelu = common_spec.Activation.GELU  # torch's F.gelu default, erf: the graphs hold Erf nodes
    encoder = transformer_spec.TransformerEncoderSpec(cfg["n_layers"], cfg["n_heads"], pre_norm=True, activation=gelu)
    decoder = transformer_spec.TransformerDecoderSpec(cfg["n_decoder_layers"], cfg["n_heads"], pre_norm=True,
                                                      activation=gelu)  # fmt: skip
    embedding = weights.pop("embed.weight")  # tied: source, target and the output layer
    encoder.embeddings[0].weight = embedding
    encoder.position_encodings.encodings = encoder_facts["positions"]
    for i, layer in enumerate(encoder.layer):
        scope = f"encoder.blocks.{i}"
        layer_norm(layer.self_attention.layer_norm, f"{scope}.ln1")
        linear(layer.self_attention.linear[0], f"{scope}.attn.q", f"{scope}.attn.k", f"{scope}.attn.v")
        linear(layer.self_attention.linear[1], f"{scope}.attn.out")
        layer_norm(layer.ffn.layer_norm, f"{scope}.ln2")
        linear(layer.ffn.linear_0, f"{scope}.mlp.fc")
        linear(layer.ffn.linear_1, f"{scope}.mlp.proj")
    layer_norm(encoder.layer_norm, "encoder.ln_f")

    decoder.embeddings.weight = embedding
    decoder.position_encodings.encodings = decoder_facts["positions"]
    for i, layer in enumerate(decoder.layer):
        scope = f"blocks.{i}"
        layer_norm(layer.self_attention.layer_norm, f"{scope}.ln1")
        linear(layer.self_attention.linear[0], f"{scope}.self_attn.q", f"{scope}.self_attn.k", f"{scope}.self_attn.v")
        linear(layer.self_attention.linear[1], f"{scope}.self_attn.out")
        layer_norm(layer.attention.layer_norm, f"{scope}.ln2")
        linear(layer.attention.linear[0], f"{scope}.cross_attn.q")
        linear(layer.attention.linear[1], f"{scope}.cross_attn.k", f"{scope}.cross_attn.v")
        linear(layer.attention.linear[2], f"{scope}.cross_attn.out")
        layer_norm(layer.ffn.layer_norm, f"{scope}.ln3")
        linear(layer.ffn.linear_0, f"{scope}.mlp.fc")
        linear(layer.ffn.linear_1, f"{scope}.mlp.proj")
    layer_norm(decoder.layer_norm, "ln_f")
    decoder.projection.weight = embedding  # F.linear(ln_f(x), embed.weight): no bias
    if weights:
        raise ValueError(f"{bundle}: parameters left unmapped: {sorted(weights)}")

    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = encoder_facts["layer_norm_epsilon"]
    spec.config.add_source_eos = bool(config.get("add_eos", True))
    spec.config.add_source_bos = bool(config.get("add_bos", False))
    pieces = vocabulary(bundle / "tokenizer.model")
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def vocabulary(tokenizer: Path) -> list[str]:
    """The SentencePiece pieces in id order; CTranslate2 maps its string tokens back to these ids."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    wrong = {i: pieces[i] for i, piece in PIECES.items() if pieces[i] != piece}
    if wrong:
        raise ValueError(f"{tokenizer}: special pieces {wrong}, expected {PIECES}")
    return pieces


def convert(bundle: Path, out: Path, quantization: str | None = None) -> Path:
    """Write the CTranslate2 model of `bundle` to `out` (replaced), with the bundle's tokenizer beside it."""
    from ctranslate2.converters.converter import Converter

    class BundleConverter(Converter):
        def _load(self):
            return transformer_spec(bundle)

    BundleConverter().convert(str(out), quantization=quantization, force=True)
    shutil.copyfile(bundle / "tokenizer.model", out / "tokenizer.model")
    return out
