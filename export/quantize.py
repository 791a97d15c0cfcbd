"""fp32 bundle -> int8 bundle: ONNX Runtime dynamic quantisation of the weights, everything else unchanged.

Dynamic quantisation (`onnxruntime.quantization.quantize_dynamic`) stores each constant-weight MatMul's
weights as int8 and quantises its input to uint8 at run time, per call, from that tensor's own range: no
calibration data. ORT then runs the pair as one DynamicQuantizeMatMul kernel (u8 x s8, VNNI where the CPU
has it; the classifier's Gemm head becomes such a MatMul too). What it does not touch stays fp32: the fused
com.microsoft MultiHeadAttention (no weights), the attention MatMuls of the decoder (both sides are
activations), LayerNorm, Gelu, the positions, and Linformer's E (its rows are sliced to the input length in
the graph, so it reaches the MatMul as an activation).

The output is a complete bundle the service loads unchanged: the same tokenizer, a config.json whose
`export.quantization` entry names the method and the fp32 bundle it came from (with sha256s), a model card,
and manifest.json from the same writer as every export.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.bundle import versions, write_json, write_manifest
from service.bundle import BundleError, verify_manifest
from training.provenance import sha256_of

# Which graph ops get int8 weights. MatMul is every dense layer (q/k/v/out, the MLP, the decoder's output
# layer). Gather is the embedding lookup: int8 there costs no speed and makes the table 4x smaller.
OP_TYPES = ("MatMul", "Gather")


def verified_files(bundle: Path) -> dict[str, str]:
    """The bundle's manifest, checked file by file as the service checks it: quantising a corrupt bundle would
    launder it."""
    try:
        return verify_manifest(bundle)["files"]
    except BundleError as e:
        raise ValueError(f"{e}; re-export the fp32 bundle") from None


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """Replace Transpose(initializer) and Concat(initializers) by initializers; returns how many were folded.

    The translation decoder keeps every Linear weight in PyTorch's layout behind a Transpose node (the torch
    export, without constant folding, so the tied embedding is stored once; the step form the same way, with
    q/k/v side by side through a Concat). quantize_dynamic only quantises a MatMul whose weight is an
    initializer, so without this fold it would quantise none of the decoder's dense layers.
    """
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    folded = []
    for node in graph.node:  # in graph order: a Concat sees the Transposes folded before it
        if not node.input or not all(name in initializers for name in node.input):
            continue
        arrays = [numpy_helper.to_array(initializers[name]) for name in node.input]
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            value = arrays[0].transpose(perm)
        elif node.op_type == "Concat":
            value = np.concatenate(arrays, axis=next(a.i for a in node.attribute if a.name == "axis"))
        else:
            continue
        initializers[node.output[0]] = numpy_helper.from_array(np.ascontiguousarray(value), name=node.output[0])
        graph.initializer.append(initializers[node.output[0]])
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    still_used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for init in [init for init in graph.initializer if init.name not in still_used]:
        graph.initializer.remove(init)  # a weight only the folded nodes read (the tied embedding is kept)
    return len(folded)


def quantize_graph(source: Path, target: Path, *, per_channel: bool) -> tuple[dict[str, int], int]:
    """Quantise one ONNX graph; returns its op counts after quantisation (MatMulInteger = int8 dense layers)
    and how many weight transposes were folded first."""
    model = onnx.load(str(source))
    folded = fold_weight_transposes(model)
    with tempfile.TemporaryDirectory() as tmp:
        unquantized = Path(tmp) / source.name
        onnx.save(model, str(unquantized))
        # ONNX's shape inference stops at com.microsoft ops (MultiHeadAttention, BiasGelu) and leaves what follows
        # untyped; every tensor these graphs compute in is float32, so that is the type to assume.
        quantize_dynamic(unquantized, target, op_types_to_quantize=list(OP_TYPES), per_channel=per_channel,
                         weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip
    return dict(sorted(Counter(node.op_type for node in onnx.load(str(target)).graph.node).items())), folded


def quantized_ops(op_counts: dict[str, int]) -> dict[str, int]:
    """What ran in int8 and what stayed fp32, from a graph's op counts (the card and config state this)."""
    return {
        "int8_matmul": op_counts.get("MatMulInteger", 0),
        "fp32_matmul": op_counts.get("MatMul", 0),
        "fp32_gemm": op_counts.get("Gemm", 0),
        "fp32_multihead_attention": op_counts.get("MultiHeadAttention", 0),
    }


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def compare_classifier(fp32: Path, int8: Path, config: dict, seed: int = 0) -> dict:
    """int8 vs fp32 logits on random token ids at a few lengths (n_max included), 4 texts each."""
    rng = np.random.default_rng(seed)
    a, b = session(fp32 / "model.onnx"), session(int8 / "model.onnx")
    vocab, n_max = config["model_config"]["vocab_size"], config["n_max"]
    lengths = sorted({n for n in (16, 128, 512) if n < n_max} | {n_max})
    worst, scale, agree, total = 0.0, 0.0, 0, 0
    for n in lengths:
        feeds = {"input_ids": rng.integers(4, vocab, (4, n)), "attention_mask": np.ones((4, n), np.int64)}
        expected, got = a.run(["logits"], feeds)[0], b.run(["logits"], feeds)[0]
        worst, scale = max(worst, float(np.abs(got - expected).max())), max(scale, float(np.abs(expected).max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(expected)
    return {"inputs": "random token ids", "lengths": lengths, "max_abs_logit_diff": worst,
            "max_abs_fp32_logit": scale, "same_label": f"{agree}/{total}"}  # fmt: skip


def compare_translator(fp32: Path, int8: Path, config: dict, steps: int = 8, seed: int = 0) -> dict:
    """int8 vs fp32 on random sources: the step decoder's logits over `steps` greedy steps fed the fp32 choices."""
    from export.step_decoder import step_logits

    rng = np.random.default_rng(seed)
    source = rng.integers(4, config["vocab_size"], (4, 24)), np.ones((4, 24), np.int64)
    (enc_a, enc_b), (dec_a, dec_b) = [(session(fp32 / f), session(int8 / f)) for f in ("encoder.onnx", "decoder.onnx")]
    logits_a, fed = step_logits(enc_a, dec_a, config, *source, steps)
    logits_b, _ = step_logits(enc_b, dec_b, config, *source, steps, forced=fed)
    return {"inputs": f"random 24-token sources, {steps} decoder steps fed the fp32 greedy tokens",
            "max_abs_logit_diff": float(np.abs(logits_b - logits_a).max()),
            "max_abs_fp32_logit": float(np.abs(logits_a).max()),
            "same_next_token": f"{int((logits_b.argmax(-1) == logits_a.argmax(-1)).sum())}/{steps * 4}"}  # fmt: skip


def int8_card(config: dict, fp32_card: str) -> str:
    quant = config["export"]["quantization"]
    source = quant["fp32_bundle"]
    ops = "; ".join(
        f"`{graph}`: {c['int8_matmul']} weight MatMuls in int8; in fp32 {c['fp32_matmul']} MatMuls between "
        f"activations (attention scores and mixing, Linformer's sliced E), {c['fp32_multihead_attention']} fused "
        f"MultiHeadAttention" + (f", {c['fp32_gemm']} Gemm" if c["fp32_gemm"] else "")
        for graph, c in quant["ops"].items()
    )
    check = quant["check"]
    agreement = check.get("same_label") or check.get("same_next_token")
    lines = [
        f"# {config['name']}",
        "",
        f"**int8 (dynamic quantisation) of `{source['name']}`**: the same model, tokenizer and interface, with the "
        "dense layers' weights stored as int8 and their inputs quantised to uint8 at run time. Select it with "
        f"`LINFORMER_{config['task'].upper()}_MODEL={config['name']}`.",
        "",
        "## Quantisation",
        f"- Method: `{quant['method']}`, weights {quant['weight_type']}, activations {quant['activation_type']}: "
        "their range is measured on every call, so there is no calibration data; "
        f"{'per-channel' if quant['per_channel'] else 'per-tensor'} weight scales; ops quantised: "
        f"{', '.join(quant['op_types'])} (Gather = the embedding table).",
        f"- Operators: {ops}. Weight transposes were folded into the weights first ({quant['transposes_folded']} "
        "folded) so the decoder's dense layers have constant weights to quantise.",
        f"- From `{source['name']}`: manifest.json sha256 `{source['manifest_sha256']}`; ONNX files "
        + ", ".join(f"`{name}` {digest}" for name, digest in source["onnx_sha256"].items()) + ".",
        f"- Check against fp32 ({check['inputs']}): max |logit difference| {check['max_abs_logit_diff']:.3g} "
        f"(largest fp32 logit {check['max_abs_fp32_logit']:.3g}); same argmax {agreement}. Accuracy, BLEU and "
        "speed against fp32 on the test sets: `benchmarks/results/int8.md` (bundles of the same name re-made "
        "since are measured in the `int8-*.md` beside it: the retrained translators in "
        "`int8-translate-gpu-trained.md`).",
        f"- Command: `{quant['command']}`",
        f"- Versions: {quant['versions']}.",
        "",
        f"The card of `{source['name']}` follows (its training, data and fp32 export parity).",
        "",
        "",
    ]
    return "\n".join(lines) + "\n".join("#" + line if line.startswith("#") else line for line in fp32_card.splitlines())


def quantize_bundle(bundle: Path, out: Path, *, name: str | None = None, per_channel: bool = False) -> dict:
    """Write the int8 twin of `bundle` to `out`; returns its config.json."""
    bundle, out = Path(bundle), Path(out)
    if bundle.resolve() == out.resolve():
        raise ValueError("--out must be a new directory: the fp32 bundle stays as it is")
    files = verified_files(bundle)
    config = json.loads((bundle / "config.json").read_text())
    if "quantization" in config.get("export", {}):
        raise ValueError(f"{bundle} is already quantised ({config['export']['quantization']['method']})")
    onnx_files = dict(config.get("onnx") or {"model": "model.onnx"})
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        stale.unlink()
    counts, folded = {}, 0
    for file in onnx_files.values():
        op_counts, folded_here = quantize_graph(bundle / file, out / file, per_channel=per_channel)
        counts[file], folded = quantized_ops(op_counts), folded + folded_here
    shutil.copyfile(bundle / "tokenizer.model", out / "tokenizer.model")
    compare = compare_translator if config["task"] == "translate" else compare_classifier
    config = {**config, "name": name or out.name}
    config["export"] = {**config["export"], "quantization": {
        "method": "onnxruntime.quantization.quantize_dynamic",
        "weight_type": "int8", "activation_type": "uint8 (dynamic)", "per_channel": per_channel,
        "op_types": list(OP_TYPES), "transposes_folded": folded, "ops": counts,
        "fp32_bundle": {"name": bundle.name, "manifest_sha256": sha256_of(bundle / "manifest.json"),
                        "onnx_sha256": {f: files[f] for f in onnx_files.values()}},
        "check": compare(bundle, out, config),
        "command": f"python -m export quantize --bundle {bundle} --out {out}"
                   + (" --per-channel" if per_channel else ""),
        "versions": versions(),
    }}  # fmt: skip
    write_json(out / "config.json", config)
    (out / "MODEL_CARD.md").write_text(int8_card(config, (bundle / "MODEL_CARD.md").read_text()))
    write_manifest(out)
    return config
