"""What the request path costs beside the model, warm and right after a model run (issue #20, the 512-token excess).

    python benchmarks/request_path.py [--bundle models/classify-linformer] [--tokens 16 64 512]

In the server the event loop's work for a request (parse and validate the body, tokenise, pad, answer) runs on
the same core as `session.run`, between runs. Timed here in one process on core 0, each step in CPU time: back
to back ("warm"), and once right after a `session.run` of the same text ("after a run"), which is the server's
case at one connection. The model's weights and activations pass through the core's caches on every run, so the
code that runs next starts cold. Writes request_path_<bundle>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import pin_to  # noqa: E402
from benchmarks.service_bench import text_of_length  # noqa: E402
from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from service.batcher import pad  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from service.runtime import CPU, make_session, probabilities  # noqa: E402
from service.schemas import ClassifyRequest  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402


def cpu_us(step: Callable[[], object], before: Callable[[], object] | None, repeats: int) -> float:
    """Median CPU microseconds of `step`, each time right after `before` (untimed) if given."""
    step()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.thread_time()
        step()
        times.append(time.thread_time() - started)
    return statistics.median(times) * 1e6


def measure(bundle_dir: Path, tokens: int, repeats: int) -> list[dict]:
    bundle = load_bundle(bundle_dir)
    tokenizer = Tokenizer.from_bundle(bundle)
    session = make_session(bundle.onnx_path("model"), [CPU], intra_op_threads=1, inter_op_threads=1,
                           cpu_mem_arena=True)  # fmt: skip  (the service's classifier session)
    text, ids = text_of_length(tokenizer, tokens)
    body = json.dumps({"text": text}).encode()
    input_ids, attention_mask = pad([ids], bundle.pad_id)
    feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
    logits = session.run(None, feeds)[0]
    labels = bundle.labels

    def answer() -> bytes:
        probs = probabilities(logits)[0]
        best = max(range(len(probs)), key=probs.__getitem__)
        result = {"label": labels[best], "score": probs[best], "scores": dict(zip(labels, probs, strict=True)),
                  "tokens": len(ids), "truncated": False}  # fmt: skip
        return json.dumps({"model": bundle.name, "results": [result]}).encode()

    steps = {
        "parse and validate the body": lambda: ClassifyRequest.model_validate(json.loads(body)),
        "tokenise": lambda: tokenizer.encode_all([text], truncate=False),
        "pad": lambda: pad([ids], bundle.pad_id),
        "softmax and answer JSON": answer,
    }

    def run() -> None:
        session.run(None, feeds)

    rows = []
    for name, step in steps.items():
        warm = cpu_us(step, None, repeats)
        cold = cpu_us(step, run, max(30, repeats // 10))
        rows.append({"tokens": len(ids), "step": name, "warm_us": round(warm, 1), "after_run_us": round(cold, 1),
                     "ratio": round(cold / warm, 2)})  # fmt: skip
    rows.append({"tokens": len(ids), "step": "session.run (batch 1)", "warm_us": round(cpu_us(run, None, 30), 1),
                 "after_run_us": "", "ratio": ""})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    load_before = load_average()
    pin_to({0})
    rows = [row for tokens in args.tokens for row in measure(args.bundle, tokens, args.repeats)]
    stem = f"request_path_{args.bundle.name}"
    write_csv(args.out / f"{stem}.csv", rows)
    plot(rows, args.out / f"{stem}.png")
    lines = header(f"The request path's steps, warm and right after a model run: {args.bundle.name}",
                   ("onnxruntime", "sentencepiece", "pydantic", "numpy"), load_before)  # fmt: skip
    lines += [
        "One process pinned to core 0, the service's classifier session (1 ORT thread, arena on). Each step's "
        "CPU time (thread_time), median: back to back (warm), and right after a `session.run` of the same text "
        "(after a run: the server's case, where the event loop's work for a request runs between model runs on "
        "the same core).",
        "",
        *markdown_table(rows, {"tokens": "tokens", "step": "step", "warm_us": "warm (µs)",
                               "after_run_us": "after a run (µs)", "ratio": "after / warm"}),
        "",
        f"![warm and after a run]({stem}.png)",
        "",
    ]  # fmt: skip
    write_markdown(args.out / f"{stem}.md", lines)


def plot(rows: list[dict], path: Path) -> None:
    steps = [row for row in rows if row["after_run_us"] != ""]
    lengths = sorted({row["tokens"] for row in steps})
    fig, axes = agg_subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.5), squeeze=False)
    for axis, length in zip(axes[0], lengths, strict=True):
        mine = [row for row in steps if row["tokens"] == length]
        x = np.arange(len(mine))
        axis.bar(x - 0.2, [row["warm_us"] for row in mine], 0.4, label="warm")
        axis.bar(x + 0.2, [row["after_run_us"] for row in mine], 0.4, label="right after session.run")
        axis.set_xticks(x, [row["step"].replace(" ", "\n", 2) for row in mine], fontsize=7)
        axis.set_ylabel("CPU µs")
        axis.set_title(f"{length}-token text", fontsize=10)
        axis.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
