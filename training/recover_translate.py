"""Rebuild a training checkpoint from a served translation bundle's ONNX weights, so that training can go on
from the served model when its run directory is gone (only the bundles are kept in git).

    python -m training.recover_translate models/translate-linformer --out runs/recovered-linformer/best.pt

Named initializers ("model.<parameter>") map directly. The exporter stored the encoder graph's linear weights
as unnamed, transposed MatMul initializers; the MatMul node's name says which parameter each one is, and the
Linformer E is the one Slice input. The result is only written if it reproduces the bundle: the rebuilt
model's logits must match ONNX Runtime's on a source (checked here; its dev perplexity should also match
the model card's).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import sentencepiece as spm
import torch
from onnx import numpy_helper

from model import ModelConfig, Translator
from training.tokenizer import BOS_ID, EOS_ID

# MatMul node name -> parameter. The Linformer encoder computes its keys and values with functional matmuls on
# the compressed input, so the exporter names them MatMul_2 and MatMul_3; the decoder's cross keys and values
# are computed in the encoder graph at the top level (/k, /v, /k_1, ...).
_ENCODER_NODE = re.compile(r"^/encoder/blocks\.(\d+)/(attn/[a-z]+|mlp/[a-z]+|attn)/MatMul(_\d+)?$")
_CROSS_NODE = re.compile(r"^/([kv])(?:_(\d+))?/MatMul$")
_LINFORMER_KEY_VALUE = {"_2": "k", "_3": "v"}


def parameter_of_matmul(node_name: str) -> str | None:
    """The model parameter whose (transposed) weight an encoder-graph MatMul node multiplies by."""
    if match := _ENCODER_NODE.match(node_name):
        block, path, suffix = match.groups()
        if path == "attn":
            if suffix not in _LINFORMER_KEY_VALUE:
                return None
            path = f"attn/{_LINFORMER_KEY_VALUE[suffix]}"
        return f"encoder.blocks.{block}.{path.replace('/', '.')}.weight"
    if match := _CROSS_NODE.match(node_name):
        kind, layer = match.groups()
        return f"blocks.{layer or 0}.cross_attn.{kind}.weight"
    return None


def recovered_state(bundle: Path, model: Translator) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for graph_file in ("encoder.onnx", "decoder.onnx"):
        graph = onnx.load(bundle / graph_file).graph
        arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for name, array in arrays.items():
            if name.startswith("model."):
                state[name.removeprefix("model.")] = torch.from_numpy(array.copy())
        for node in graph.node:
            weights = [name for name in node.input if name in arrays and not name.startswith("model.")]
            if node.op_type == "MatMul" and weights:
                parameter = parameter_of_matmul(node.name)
                if parameter is None:
                    raise ValueError(f"{graph_file}: no parameter known for MatMul node {node.name}")
                state[parameter] = torch.from_numpy(arrays[weights[0]].T.copy())
            elif node.op_type == "Slice" and weights:  # the Linformer E, shared by every layer
                for parameter in model.state_dict():
                    if parameter.startswith("encoder.projections."):
                        shape = model.state_dict()[parameter].shape
                        state[parameter] = torch.from_numpy(arrays[weights[0]].copy()).reshape(shape)
    state["encoder.embed.weight"] = state["embed.weight"]  # one tied embedding
    return state


def check_against_onnx(bundle: Path, model: Translator, source_ids: list[int]) -> float:
    """Max |logit difference| between the rebuilt model and ONNX Runtime on one source, first decoder step."""
    from export.step_decoder import step_logits  # the bundle's decoder.onnx is the step form

    ids = torch.tensor([source_ids])
    mask = torch.ones_like(ids)
    encoder = ort.InferenceSession(str(bundle / "encoder.onnx"), providers=["CPUExecutionProvider"])
    decoder = ort.InferenceSession(str(bundle / "decoder.onnx"), providers=["CPUExecutionProvider"])
    config = json.loads((bundle / "config.json").read_text())
    onnx_logits = step_logits(encoder, decoder, config, ids.numpy(), mask.numpy(), steps=1)[0][0]  # (1, V)
    with torch.no_grad():
        logits, _ = model.decode(torch.tensor([[BOS_ID]]), model.encode(ids, mask), None)
    return float(np.abs(onnx_logits - logits[:, -1].numpy()).max())


def recover(bundle: Path, out: Path, data: str) -> dict:
    config = json.loads((bundle / "config.json").read_text())
    model = Translator(ModelConfig(**config["model_config"])).eval()
    model.load_state_dict(recovered_state(bundle, model), strict=True)
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer.model"))
    text = "Click the Save button to keep the changes you made to the document."
    source = sp.encode(text)[: model.cfg.n_max - 1] + [EOS_ID]
    max_diff = check_against_onnx(bundle, model, source)
    if max_diff > 1e-3:
        raise ValueError(f"rebuilt model differs from {bundle}: max |logit difference| {max_diff:.3g}")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"model": model.state_dict(), "model_config": asdict(model.cfg),
         "extra": {"task": "translate", "data": data, "recovered_from": str(bundle)}},
        out,
    )  # fmt: skip
    return {"bundle": str(bundle), "out": str(out), "max_abs_logit_diff": max_diff}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", default=".cache/data/ende-v1", help="the data the bundle was trained on")
    args = parser.parse_args(argv)
    print(json.dumps(recover(args.bundle, args.out, args.data)))


if __name__ == "__main__":
    main()
