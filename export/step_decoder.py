"""The translation decoder as one small graph per decoder step, with the self-attention cache kept outside it.

decoder.onnx as torch.onnx.export writes it has 760 nodes (shape arithmetic for the cache and the causal mask,
MatMul/Softmax attention) and returns the whole grown cache each step: at batch 1 a step is mostly ORT's
per-node cost, and every step copies the cache twice (into the Concat, out as `present`). This graph is built
from the same weights (read from that decoder.onnx, as export/ctranslate2.py does) with ONNX Runtime's fused
kernels, about 70 nodes:

- self-attention is `com.microsoft::GroupQueryAttention` (kv heads = heads) over a cache buffer of `tgt_n_max`
  positions per row that the caller owns and binds both as `past_*` and `present_*` (IO binding, one buffer):
  the kernel writes the new key/value column in place at each row's own length (`past_lengths`) and attends
  over that row's positions only. So rows of different lengths share one call without paying for the longest
  row (the stepmask branch's lesson), and a step copies one column per row instead of the whole cache;
- cross-attention is `com.microsoft::GroupQueryAttention` too, over the encoder's keys/values (B, H, S', hd) in
  buffers the caller binds as past and present, with each row's own source length (`cross_lengths`): a row
  attends over its own source's positions only, so rows of short and long sources share one call without the
  short ones paying the longest one's width (a MultiHeadAttention with a key padding mask, the form before,
  computed every row over the widest source: with 16 live rows whose sources spread over 16-256 positions a step
  is 1.23-1.39x as fast this way, 4 rows 1.18-1.23x, 1 row the same; benchmarks/decode_bench.py,
  benchmarks/results/ragged-cross-session22/). The kernel appends the one new key/value it is given at each
  row's `cross_lengths - 1`: the caller passes the row's last source position (`cross_last_*`), which the kernel
  writes over itself, so nothing changes in the buffer and every row attends over exactly its source;
- one new token per row, so activations are (B, C) and every Linear is a MatMul + Add; q/k/v of
  self-attention are one MatMul. Weights stay named initializers in PyTorch's (out, in) layout behind
  Transpose/Concat nodes, which ONNX Runtime folds once at load (and export/quantize.py folds before
  quantising), so export/ctranslate2.py still finds every weight by its PyTorch name.

decoder.onnx (step form)
    input_ids int64 (B, 1), past_lengths int32 (B): target tokens already cached per row (= the new token's
    position), total_length int32 (1): max(past_lengths) + 1, past_key_i/past_value_i float (B, H, T_max, hd),
    cross_key_i/cross_value_i float (B, H, S', hd), cross_last_key_i/cross_last_value_i float (B, 1, H*hd): each row's
    key/value at its last source position, cross_lengths int32 (B): each row's source positions (its cross mask
    is a prefix: sources are padded on the right), cross_total int32 (1): max(cross_lengths)
    -> logits (B, V), present_key_i/present_value_i: the same buffers as past_* when bound to them,
    present_cross_key_i/present_cross_value_i: the same buffers as cross_* (bind them so: unbound, ONNX Runtime
    would copy the whole cross cache every step).

    python -m export step-decoder --bundle models/translate-transformer   (rewrites decoder.onnx in place)

The command also rebuilds a decoder.onnx of the earlier step form (cross-attention as MultiHeadAttention over a
`cross_mask`) from its own weights, checked against it.
"""

from __future__ import annotations

import functools
import itertools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from export.ctranslate2 import graph_facts
from service.runtime import TranslatorRuntime, bind_array

OPSET = 17
IR_VERSION = 8
STEP_INTERFACE = ("step: past_lengths, cache buffers bound as past and present (GroupQueryAttention); cross-attention "
                  "by GroupQueryAttention over cross_lengths")


def weights_of_exported_decoder(decoder_onnx: Path, d_model: int) -> tuple[dict[str, np.ndarray], dict]:
    """The parameters (PyTorch names) and facts (LayerNorm epsilon, position table) of a torch-form decoder.onnx."""
    graph = onnx.load(str(decoder_onnx)).graph
    weights = {init.name.removeprefix("model."): numpy_helper.to_array(init)
               for init in graph.initializer if init.name.startswith("model.")}  # fmt: skip
    return weights, graph_facts(decoder_onnx, d_model)


def weights_of_model(model) -> tuple[dict[str, np.ndarray], dict]:
    """The same from a PyTorch Translator (export from a checkpoint)."""
    weights = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    return weights, {"layer_norm_epsilon": model.ln_f.eps, "positions": model.tgt_pos.numpy()}


class _GraphBuilder:
    """Nodes and initializers of one graph, with names made from a counter."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.count = 0

    def node(self, op: str, inputs: list[str], n_outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        self.count += 1
        outputs = [f"{op.lower()}_{self.count}_{i}" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{self.count}", domain=domain, **attrs))
        return outputs

    def one(self, op: str, *inputs: str, domain: str = "", **attrs) -> str:
        return self.node(op, list(inputs), 1, domain, **attrs)[0]

    def constant(self, value: np.ndarray) -> str:
        return self.one("Constant", value=numpy_helper.from_array(value))

    def weight(self, name: str) -> str:
        """A parameter by its PyTorch name, stored (once) as the initializer `model.<name>`, as torch exports it."""
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(self.weights[name], f"model.{name}")
        return f"model.{name}"


def build_step_decoder(weights: dict[str, np.ndarray], facts: dict, config: dict) -> onnx.ModelProto:
    """The step-form decoder of a translation bundle from its parameters (PyTorch names) and facts."""
    cfg = config["model_config"]
    d, heads, layers = cfg["d_model"], cfg["n_heads"], cfg["n_decoder_layers"]
    head_dim = d // heads
    g = _GraphBuilder(weights)
    eps = facts["layer_norm_epsilon"]

    def linear(x: str, *names: str) -> str:
        """x (B, in) -> x W^T + b; several names: one MatMul over their weights side by side (q;k;v)."""
        transposed = [g.one("Transpose", g.weight(f"{name}.weight"), perm=[1, 0]) for name in names]
        weight = transposed[0] if len(names) == 1 else g.one("Concat", *transposed, axis=1)
        biases = [g.weight(f"{name}.bias") for name in names]
        bias = biases[0] if len(names) == 1 else g.one("Concat", *biases, axis=0)
        return g.one("Add", g.one("MatMul", x, weight), bias)

    def layer_norm(x: str, name: str) -> str:
        scale, shift = g.weight(f"{name}.weight"), g.weight(f"{name}.bias")
        return g.one("LayerNormalization", x, scale, shift, axis=-1, epsilon=eps)

    rows_one_token = g.constant(np.array([0, 1, d], np.int64))  # (B, C) <-> (B, 1, C) for the attention kernels
    rows_channels = g.constant(np.array([0, d], np.int64))
    tokens = g.one("Reshape", "input_ids", g.constant(np.array([-1], np.int64)))  # (B,)
    positions = g.one("Cast", "past_lengths", to=TensorProto.INT64)
    # the graph_facts constants (embedding scale, position table) stay Constant nodes, as in the torch export
    scale = g.constant(np.array(np.sqrt(d), np.float32))
    table = g.constant(facts["positions"].astype(np.float32))
    x = g.one("Add", g.one("Mul", g.one("Gather", g.weight("embed.weight"), tokens, axis=0), scale),
              g.one("Gather", table, positions, axis=0))  # (B, C)  # fmt: skip
    last_source_position = g.one("Sub", "cross_lengths", g.constant(np.array(1, np.int32)))
    for i in range(layers):
        scope = f"blocks.{i}"
        qkv = g.one("Reshape", linear(layer_norm(x, f"{scope}.ln1"), *(f"{scope}.self_attn.{p}" for p in "qkv")),
                    g.constant(np.array([0, 1, 3 * d], np.int64)))  # packed (B, 1, 3C)  # fmt: skip
        attended = g.node(
            "GroupQueryAttention", [qkv, "", "", f"past_key_{i}", f"past_value_{i}", "past_lengths", "total_length"],
            3, "com.microsoft", num_heads=heads, kv_num_heads=heads,
        )
        g.nodes[-1].output[1:] = [f"present_key_{i}", f"present_value_{i}"]
        x = g.one("Add", x, linear(g.one("Reshape", attended[0], rows_channels), f"{scope}.self_attn.out"))
        query = g.one("Reshape", linear(layer_norm(x, f"{scope}.ln2"), f"{scope}.cross_attn.q"), rows_one_token)
        crossed = g.node(
            "GroupQueryAttention", [query, f"cross_last_key_{i}", f"cross_last_value_{i}", f"cross_key_{i}",
                                    f"cross_value_{i}", last_source_position, "cross_total"],
            3, "com.microsoft", num_heads=heads, kv_num_heads=heads,
        )[0]  # fmt: skip
        g.nodes[-1].output[1:] = [f"present_cross_key_{i}", f"present_cross_value_{i}"]
        x = g.one("Add", x, linear(g.one("Reshape", crossed, rows_channels), f"{scope}.cross_attn.out"))
        hidden = g.one("Gelu", linear(layer_norm(x, f"{scope}.ln3"), f"{scope}.mlp.fc"), domain="com.microsoft")
        x = g.one("Add", x, linear(hidden, f"{scope}.mlp.proj"))
    embed_t = g.one("Transpose", g.weight("embed.weight"), perm=[1, 0])  # tied output layer, no bias
    g.nodes.append(helper.make_node("MatMul", [layer_norm(x, "ln_f"), embed_t], ["logits"], name="output_layer"))

    batch, cache, memory = "batch", ["batch", heads, "max_length", head_dim], ["batch", heads, "memory", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, 1]),
        helper.make_tensor_value_info("past_lengths", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("total_length", TensorProto.INT32, [1]),
        *[helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, cache)
          for i in range(layers) for kind in ("key", "value")],
        *[helper.make_tensor_value_info(f"cross_{kind}_{i}", TensorProto.FLOAT, memory)
          for i in range(layers) for kind in ("key", "value")],
        *[helper.make_tensor_value_info(f"cross_last_{kind}_{i}", TensorProto.FLOAT, [batch, 1, d])
          for i in range(layers) for kind in ("key", "value")],
        helper.make_tensor_value_info("cross_lengths", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("cross_total", TensorProto.INT32, [1]),
    ]  # fmt: skip
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, cfg["vocab_size"]]),
        *[helper.make_tensor_value_info(f"present_{kind}_{i}", TensorProto.FLOAT, cache)
          for i in range(layers) for kind in ("key", "value")],
        *[helper.make_tensor_value_info(f"present_cross_{kind}_{i}", TensorProto.FLOAT, memory)
          for i in range(layers) for kind in ("key", "value")],
    ]  # fmt: skip
    graph = helper.make_graph(g.nodes, "translate_step_decoder", inputs, outputs, list(g.initializers.values()))
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    # IR 8, as torch.onnx.export writes the encoders: onnx's default (the newest IR) does not load in the older
    # onnxruntime releases pyproject.toml allows (1.20 reads IR <= 10)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="linformer-serve export.step_decoder",
                              ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def decoder_form(decoder_onnx: Path) -> str:
    """"torch" (as torch.onnx.export writes it), "earlier step" (cross-attention over a cross_mask) or "step"."""
    inputs = {i.name for i in onnx.load(str(decoder_onnx), load_external_data=False).graph.input}
    if "past_lengths" not in inputs:
        return "torch"
    return "step" if "cross_lengths" in inputs else "earlier step"


def bind_cross(decoder: ort.InferenceSession, binding: ort.IOBinding, cross: dict[str, np.ndarray],
               cross_mask: np.ndarray) -> list[np.ndarray]:  # fmt: skip
    """Bind the encoder's cross keys/values (name -> (B, H, S', hd)) and cross_mask (B, S', a prefix per row) to a
    step-form decoder: the cross caches as past and present, each row's last source key/value, the lengths and the
    longest; the earlier step form takes the mask as it is. -> the arrays bound: keep them while the binding is."""
    bind = functools.partial(bind_array, binding)
    if "cross_mask" in {i.name for i in decoder.get_inputs()}:
        kept = [np.ascontiguousarray(a) for a in (*cross.values(), cross_mask)]
        for name, array in zip([*cross, "cross_mask"], kept, strict=True):
            bind(name, array)
        return kept
    lengths = cross_mask.sum(axis=1).astype(np.int32)
    rows = np.arange(len(lengths))
    kept = [lengths, np.array([lengths.max()], np.int32)]
    bind("cross_lengths", kept[0])
    bind("cross_total", kept[1])
    for name, array in cross.items():
        array = np.ascontiguousarray(array)  # the kernel writes each row's last position over itself
        last = np.ascontiguousarray(array[rows, :, lengths - 1].reshape(len(rows), 1, -1))
        bind(name, array)
        bind(f"present_{name}", array, output=True)
        bind(name.replace("cross_", "cross_last_"), last)
        kept += [array, last]
    return kept


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _torch_form_greedy(encoder, decoder, config: dict, input_ids: np.ndarray, attention_mask: np.ndarray,
                       max_new_tokens: int) -> list[list[int]]:  # fmt: skip
    """Greedy decoding with the exported (whole-cache) decoder: the reference the step form must reproduce."""
    layers, heads, head_dim = config["n_decoder_layers"], config["n_heads"], config["head_dim"]
    names = [f"{{}}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    cross_names = [n.format("cross") for n in names] + ["cross_mask"]
    rows = len(input_ids)
    feeds = dict(zip(cross_names, encoder.run(cross_names, {"input_ids": input_ids, "attention_mask": attention_mask}),
                     strict=True))  # fmt: skip
    feeds.update({n.format("past"): np.zeros((rows, heads, 0, head_dim), np.float32) for n in names})
    tokens = np.full((rows, 1), config["special_tokens"]["bos_id"], np.int64)
    eos = config["special_tokens"]["eos_id"]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    done = np.zeros(rows, bool)
    for _ in range(min(max_new_tokens, config["tgt_n_max"])):
        outputs_wanted = ["logits", *[n.format("present") for n in names]]
        logits, *presents = decoder.run(outputs_wanted, {**feeds, "input_ids": tokens})
        next_tokens = logits[:, -1].argmax(-1)
        for row, token in enumerate(next_tokens.tolist()):
            if not done[row] and token != eos:
                outputs[row].append(token)
        done |= next_tokens == eos
        if done.all():
            break
        feeds.update(zip([n.format("past") for n in names], presents, strict=True))
        tokens = next_tokens[:, None].astype(np.int64)
    return outputs


def _step_form_greedy(encoder, decoder, config: dict, input_ids: np.ndarray, attention_mask: np.ndarray,
                      max_new_tokens: int) -> list[list[int]]:  # fmt: skip
    """Greedy decoding with an earlier step-form decoder (every row for the whole length, then cut at its EOS)."""
    logits, fed = step_logits(encoder, decoder, config, input_ids, attention_mask,
                              min(max_new_tokens, config["tgt_n_max"]))  # fmt: skip
    tokens = np.concatenate([fed[:, 1:], logits[-1].argmax(-1)[:, None]], axis=1)
    eos = config["special_tokens"]["eos_id"]
    return [list(itertools.takewhile(lambda token: token != eos, row)) for row in tokens.tolist()]


def step_logits(encoder, decoder, config: dict, input_ids: np.ndarray, attention_mask: np.ndarray, steps: int,
                forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`steps` calls of a step-form decoder on these sources, all rows in step: -> logits (steps, rows, V) and
    the tokens fed (rows, steps), BOS then each step's argmax, or `forced` (rows, steps) when given."""
    layers, heads, head_dim = config["n_decoder_layers"], config["n_heads"], config["head_dim"]
    names = [f"{{}}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    cross_names = [n.format("cross") for n in names]
    rows = len(input_ids)
    *cross, cross_mask = encoder.run([*cross_names, "cross_mask"],
                                     {"input_ids": input_ids, "attention_mask": attention_mask})  # fmt: skip
    cross = dict(zip(cross_names, cross, strict=True))
    caches = [np.zeros((rows, heads, config["tgt_n_max"], head_dim), np.float32) for _ in names]
    fed = np.full((rows, steps), config["special_tokens"]["bos_id"], np.int64) if forced is None else forced
    out = []
    for step in range(steps):
        binding = decoder.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(fed[:, step : step + 1]))
        binding.bind_cpu_input("past_lengths", np.full(rows, step, np.int32))
        binding.bind_cpu_input("total_length", np.array([step + 1], np.int32))
        kept = bind_cross(decoder, binding, cross, cross_mask)
        for name, cache in zip(names, caches, strict=True):
            bind_array(binding, name.format("past"), cache)
            bind_array(binding, name.format("present"), cache, output=True)
        logits = np.empty((rows, config["vocab_size"]), np.float32)
        bind_array(binding, "logits", logits, output=True)
        decoder.run_with_iobinding(binding)
        del kept
        out.append(logits)
        if forced is None and step + 1 < steps:
            fed[:, step + 1] = logits.argmax(-1)
    return np.stack(out), fed


def check_step_parity(bundle: Path, reference_decoder: Path, sources: list[list[int]], max_new_tokens: int = 256,
                      batch_size: int = 25) -> dict:  # fmt: skip
    """Greedy outputs of the bundle's step-form decoder (through the service runtime, as served) against the
    decoder it was built from (the torch form, or the earlier step form), on `sources` (token ids with EOS),
    batched alike."""
    from service.batcher import pad

    config = json.loads((bundle / "config.json").read_text())
    encoder = _session(bundle / "encoder.onnx")
    form = decoder_form(reference_decoder)
    greedy = _torch_form_greedy if form == "torch" else _step_form_greedy
    reference = _session(reference_decoder)
    runtime = TranslatorRuntime(encoder, _session(bundle / "decoder.onnx"), n_layers=config["n_decoder_layers"],
                                n_heads=config["n_heads"], head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"],
                                bos_id=config["special_tokens"]["bos_id"], eos_id=config["special_tokens"]["eos_id"],
                                length_penalty_alpha=config["export"].get("length_penalty_alpha", 0.6))  # fmt: skip
    pad_id = config["special_tokens"]["pad_id"]
    identical = 0
    for start in range(0, len(sources), batch_size):
        ids, mask = pad(sources[start : start + batch_size], pad_id)
        expected = greedy(encoder, reference, config, ids, mask, max_new_tokens)
        served = runtime.run(ids, mask, (1, max_new_tokens))
        identical += sum(a == b for a, b in zip(served, expected, strict=True))
    return {"sentences": len(sources), "reference": f"the {form} form", "greedy_identical": identical,
            "max_new_tokens": max_new_tokens}  # fmt: skip


def parity_sources_from_tsv(bundle: Path, tsv: Path, sentences: int) -> list[list[int]]:
    """The first `sentences` English sources of a test.tsv (header `source en de`), tokenised as served."""
    import csv

    import sentencepiece as spm

    config = json.loads((bundle / "config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer.model"))
    eos = config["special_tokens"]["eos_id"]
    with tsv.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:sentences]
    return [sp.encode(row["en"])[: config["n_max"] - 1] + [eos] for row in rows]


def convert_bundle(bundle: Path, parity_sources: list[list[int]] | None = None,
                   parameters: tuple[dict[str, np.ndarray], dict] | None = None) -> dict:  # fmt: skip
    """Rewrite `bundle`'s torch-form (or earlier step-form) decoder.onnx as the step form (in place), check greedy
    parity against the decoder it replaces on `parity_sources` (default: 64 random sources), update config.json, the
    card and manifest.json. The weights come from that decoder.onnx, or from `parameters` (weights_of_model) when
    exporting from a checkpoint."""
    from export.bundle import write_json, write_manifest

    config = json.loads((bundle / "config.json").read_text())
    decoder = bundle / "decoder.onnx"
    form = decoder_form(decoder)
    if form == "step":
        raise ValueError(f"{decoder} is already the step form")
    if "quantization" in config["export"]:
        raise ValueError(f"{bundle} is quantised: convert its fp32 bundle, then quantise again")
    if parity_sources is None:
        rng = np.random.default_rng(0)
        vocab, eos = config["vocab_size"], config["special_tokens"]["eos_id"]
        parity_sources = [[*rng.integers(4, vocab, int(n)).tolist(), eos] for n in rng.integers(4, 60, 64)]
    model = build_step_decoder(*(parameters or weights_of_exported_decoder(decoder, config["model_config"]["d_model"])),
                               config)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        replaced = Path(tmp) / "decoder.onnx"
        shutil.copyfile(decoder, replaced)
        onnx.save(model, str(decoder))
        try:
            parity = check_step_parity(bundle, replaced, parity_sources)
            if parity["greedy_identical"] < 0.99 * parity["sentences"]:
                raise RuntimeError(f"the step-form decoder disagrees with the {form} form it replaces: {parity}")
        except Exception:
            shutil.copyfile(replaced, decoder)  # leave the bundle as it was
            raise
    if form == "earlier step":  # the chain back to the exported decoder: the earlier form's own check
        parity["earlier_step_parity"] = config["export"].get("step_parity")
    config["export"] = {**config["export"], "decoder_form": STEP_INTERFACE, "step_parity": parity}
    write_json(bundle / "config.json", config)
    card = bundle / "MODEL_CARD.md"
    text = card.read_text()
    if "\n## Decoder form\n" in text:  # the section is the card's last (written here)
        text = text[: text.index("\n## Decoder form\n")]
    card.write_text(text.rstrip("\n") + "\n\n" + step_card_section(parity) + "\n")
    write_manifest(bundle)
    return config


def step_card_section(parity: dict) -> str:
    earlier = parity.get("earlier_step_parity")
    chain = "" if not earlier else (
        " That form's greedy outputs had been identical to the exported decoder's on "
        f"{earlier.get('greedy_identical', earlier.get('greedy_identical_to_torch_form'))}/{earlier['sentences']} "
        "sources."
    )
    return (
        "## Decoder form\n"
        "`decoder.onnx` is the step form (export/step_decoder.py): one new token per row, the self-attention "
        "cache in buffers the runtime binds as past and present (GroupQueryAttention appends in place at each row's "
        "own length), cross-attention as GroupQueryAttention over each row's own source length; built from the "
        f"weights of the decoder it replaced ({parity['reference']}). Greedy outputs identical to that decoder's on "
        f"{parity['greedy_identical']}/{parity['sentences']} sources (at most {parity['max_new_tokens']} new "
        f"tokens).{chain}"
    )
