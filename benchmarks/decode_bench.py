"""One decoder step, an earlier form vs the step form: time per call, graph size and where the time goes (a benchmark).

- the reference (`--reference`, taken from git history, see below), either
  - the torch form: decoder.onnx as torch.onnx.export writes it (the bundles before the step form), fed the whole
    cache as numpy arrays and returning the grown cache (`present`), as the runtime called it before; or
  - the earlier step form: the step form whose cross-attention was MultiHeadAttention over a cross_mask, every row
    computed over the widest source (the bundles before the twenty-second session);
- step form: the bundle's decoder.onnx now (export/step_decoder.py), with its cache buffers and every input and
  output bound once (IO binding, as service/runtime.py's LiveDecode binds them); a call is run_with_iobinding.

For each batch (rows) and cache length (target tokens already decoded, the same for every row) the two take turns
call by call, `--calls` calls each, median of `--rounds` rounds. The source (cross keys) is --memory positions for
every row, or with `--spread` the rows' sources spread evenly from 16 to --memory positions (the rest of each row
padding, masked), as a mixed load's live rows are.
Also: the node count after ONNX Runtime's optimiser (ORT_ENABLE_ALL) of each graph, the fixed cost of a
session.run on a one-node graph, and for the step form ORT's profiler split of one call by operator (profiling
slows every node down, so the split is a share, not a time). Writes CSV + Markdown + PNG.

    git show 0cd131b:models/translate-transformer/decoder.onnx > .cache/torch-form-decoder.onnx
    .venv/bin/python -m benchmarks.decode_bench --reference .cache/torch-form-decoder.onnx
    git show 32ac18c:models/translate-linformer/decoder.onnx > .cache/earlier-step-decoder.onnx
    .venv/bin/python -m benchmarks.decode_bench --bundle models/translate-linformer \
        --reference .cache/earlier-step-decoder.onnx --memory 256 --spread --rows 1,4,16 --cached 20,100 \
        --out benchmarks/results/ragged-cross-session22/decode-linformer
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from export.step_decoder import bind_cross, decoder_form  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service.runtime import bind_array  # noqa: E402


def session(path: Path, *, profile: bool = False, optimized: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.enable_profiling = profile
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


class Calls:
    """One decoder call, ready to repeat, for `rows` rows with `cached` tokens decoded."""

    def __init__(self, decoder: ort.InferenceSession, config: dict, rows: int, cached: int, memory: int, step: bool,
                 spread: bool = False):  # fmt: skip
        rng = np.random.default_rng(0)
        layers, heads, head_dim = config["n_decoder_layers"], config["n_heads"], config["head_dim"]
        names = [f"{{}}_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
        cross = {n.format("cross"): rng.standard_normal((rows, heads, memory, head_dim), np.float32) for n in names}
        cross_mask = np.ones((rows, memory), bool)
        if spread:  # row r's source: the first lengths[r] positions
            lengths = np.linspace(min(16, memory), memory, rows).round().astype(int) if rows > 1 else [memory]
            cross_mask = np.arange(memory)[None, :] < np.array(lengths)[:, None]
        tokens = np.full((rows, 1), 5, np.int64)
        self.decoder = decoder
        if not step:
            past = {n.format("past"): rng.standard_normal((rows, heads, cached, head_dim), np.float32) for n in names}
            self.feeds = {"input_ids": tokens, **cross, "cross_mask": cross_mask, **past}
            self.outputs = ["logits", *[n.format("present") for n in names]]
            self.call = lambda: decoder.run(self.outputs, self.feeds)
            return
        self.keep = [tokens, np.full(rows, cached, np.int32), np.array([cached + 1], np.int32),
                     np.empty((rows, config["vocab_size"]), np.float32)]  # fmt: skip
        self.keep += [np.zeros((rows, heads, config["tgt_n_max"], head_dim), np.float32) for _ in names]
        self.binding = binding = decoder.io_binding()
        bind = functools.partial(bind_array, binding)
        for name, array in zip(("input_ids", "past_lengths", "total_length"), self.keep, strict=False):
            bind(name, array)
        bind("logits", self.keep[3], output=True)
        self.keep += bind_cross(decoder, binding, cross, cross_mask)
        for name, cache in zip(names, self.keep[4:], strict=False):
            bind(name.format("past"), cache)
            bind(name.format("present"), cache, output=True)
        self.call = lambda: decoder.run_with_iobinding(binding)


def time_calls(calls: dict[str, Calls], n: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean ms per call, the forms taking turns call by call."""
    for c in calls.values():
        for _ in range(10):
            c.call()
    per_round: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        spent = dict.fromkeys(calls, 0.0)
        for _ in range(n):
            for form, c in calls.items():
                started = time.perf_counter()
                c.call()
                spent[form] += time.perf_counter() - started
        for form in calls:
            per_round[form].append(1000 * spent[form] / n)
    return {form: statistics.median(times) for form, times in per_round.items()}


def optimized_nodes(path: Path) -> Counter:
    with tempfile.TemporaryDirectory() as tmp:
        session(path, optimized=Path(tmp) / "optimized.onnx")
        return Counter(node.op_type for node in onnx.load(str(Path(tmp) / "optimized.onnx")).graph.node)


def run_overhead_us(n: int = 5000) -> float:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(helper.make_model(graph), str(Path(tmp) / "identity.onnx"))
        one = session(Path(tmp) / "identity.onnx")
    x = np.zeros(1, np.float32)
    started = time.perf_counter()
    for _ in range(n):
        one.run(None, {"x": x})
    return 1e6 * (time.perf_counter() - started) / n


def operator_split(path: Path, config: dict, rows: int, cached: int, memory: int, spread: bool,
                   n: int = 300) -> list[dict]:  # fmt: skip
    decoder = session(path, profile=True)  # writes its trace in the working directory; removed below
    calls = Calls(decoder, config, rows, cached, memory, step=True, spread=spread)
    for _ in range(n):
        calls.call()
    trace_file = Path(decoder.end_profiling())
    trace = json.loads(trace_file.read_text())
    trace_file.unlink()
    by_op: Counter = Counter()
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"]
    total = sum(by_op.values())
    return [{"operator": op, "share_of_kernel_time": f"{100 * t / total:.1f} %"} for op, t in by_op.most_common()]


REFERENCE_LABELS = {"torch": "torch form (whole cache in and out)",
                    "earlier step": "earlier step form (MultiHeadAttention cross over the widest source)"}


def plot(rows: list[dict], path: Path, reference: str) -> None:
    labels = [f"{r['rows']} rows, {r['cached']} cached" for r in rows]
    x = np.arange(len(rows))
    fig, ax = agg_subplots(figsize=(8, 4))
    ax.bar(x - 0.2, [r["reference_ms"] for r in rows], 0.4, label=REFERENCE_LABELS[reference])
    ax.bar(x + 0.2, [r["step_form_ms"] for r in rows], 0.4, label="step form (IO-bound buffers, GQA in place)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per decoder call (1 thread)")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "translate-transformer")
    parser.add_argument("--reference", type=Path, required=True,
                        help="the torch-form or earlier step-form decoder.onnx of that bundle (from git history)")
    parser.add_argument("--rows", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--cached", default="20,200", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--memory", type=int, default=32, help="source positions (cross keys)")
    parser.add_argument("--spread", action="store_true", help="rows' sources from 16 to --memory positions")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "decode-step")
    args = parser.parse_args(argv)
    load_before = load_average()
    config = json.loads((args.bundle / "config.json").read_text())
    step_path = args.bundle / "decoder.onnx"
    reference = decoder_form(args.reference)
    forms = {"reference": session(args.reference), "step_form": session(step_path)}
    rows = []
    for batch in args.rows:
        for cached in args.cached:
            calls = {form: Calls(s, config, batch, cached, args.memory, step=form == "step_form" or
                                 reference != "torch", spread=args.spread)
                     for form, s in forms.items()}  # fmt: skip
            ms = time_calls(calls, args.calls, args.rounds)
            rows.append({"rows": batch, "cached": cached, "memory": args.memory,
                         "sources": f"16-{args.memory}" if args.spread and batch > 1 else str(args.memory),
                         "reference_ms": round(ms["reference"], 4), "step_form_ms": round(ms["step_form"], 4),
                         "reference_over_step_form": round(ms["reference"] / ms["step_form"], 2),
                         "load": load_average()})  # fmt: skip
            print(rows[-1], flush=True)
    nodes = {f"{reference} form": optimized_nodes(args.reference), "step form": optimized_nodes(step_path)}
    overhead = run_overhead_us()
    split = operator_split(step_path, config, args.rows[-1], args.cached[0], args.memory, args.spread)
    write_csv(args.out.with_suffix(".csv"), rows)
    plot(rows, args.out.with_suffix(".png"), reference)
    sources = (f"sources spread evenly from 16 to {args.memory} positions over the rows" if args.spread else
               f"source of {args.memory} positions")  # fmt: skip
    lines = header(f"One decoder step: {reference} form vs step form", ("onnxruntime", "numpy"), load_before)
    lines += [
        f"Bundle `{args.bundle.name}` (d 128, 3 decoder layers, vocabulary 8000), 1 ORT thread, {sources}; the "
        f"two forms take turns call by call, {args.calls} calls per round, median of {args.rounds} rounds. "
        f"Reference: `{args.reference}`, {REFERENCE_LABELS[reference]}.",
        "",
        *markdown_table(rows, {"rows": "rows", "cached": "cached tokens", "sources": "source positions",
                               "reference_ms": f"{reference} form ms/call", "step_form_ms": "step form ms/call",
                               "reference_over_step_form": "reference / step", "load": "load"}),  # fmt: skip
        "",
        f"![ms per call]({args.out.name}.png)",
        "",
        "## Graph size after ORT's optimiser (ORT_ENABLE_ALL)",
        "",
        *[f"- {form}: {sum(c.values())} nodes ({', '.join(f'{op} {k}' for op, k in c.most_common())})"
          for form, c in nodes.items()],  # fmt: skip
        f"- session.run of a one-node (Identity) graph: {overhead:.1f} µs: the fixed cost of a call.",
        "",
        f"## Step form, {args.rows[-1]} rows, {args.cached[0]} cached: ORT profiler's kernel time by operator",
        "",
        *markdown_table(split, {"operator": "operator", "share_of_kernel_time": "share of kernel time"}),
        "",
    ]
    write_markdown(args.out.with_suffix(".md"), lines)


if __name__ == "__main__":
    main()
