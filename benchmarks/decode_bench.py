"""Benchmark decoding on a translation bundle: the key/value cache vs recomputing the prefix (not a test).

Both modes run the bundle's own decoder.onnx under ONNX Runtime and produce the same greedy tokens:
- cache: each step feeds only the newest token and the cache of the previous steps;
- recompute: each step feeds the whole prefix [BOS, y1, ..., yt] with an empty cache, as a decoder
  without a cache must.
Every run decodes exactly `steps` tokens (EOS does not stop it), so both modes do the same number of
steps; tokens/s = batch x steps / seconds, the encoder included once per run in both. Modes are
interleaved (A B A B) and the median of the repeats is reported. Writes CSV + Markdown + PNG.

    python benchmarks/decode_bench.py --bundle models/translate-linformer [--out benchmarks/results]
"""

import argparse
import csv
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.bundle import load_bundle  # noqa: E402
from service.runtime import make_session  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

SOURCES = [
    "Click the Insert tab and choose a table.",
    "The selected cells are copied to the clipboard.",
    "Opens a dialog where you can define the page style.",
    "Select the text that you want to format, then choose Format - Character.",
    "This function returns the number of days between two dates.",
    "Enter the name of the new database in the box.",
    "If the check box is selected, the changes are saved automatically.",
    "Choose Tools - Options - LibreOffice Writer - General.",
]


class Decoder:
    def __init__(self, bundle_path: Path, threads: int):
        bundle = load_bundle(bundle_path)
        self.config = bundle.config
        self.bos_id = bundle.bos_id
        self.tokenizer = Tokenizer.from_bundle(bundle)
        self.encoder = make_session(bundle.onnx_path("encoder"), ["CPUExecutionProvider"], intra_op_threads=threads)
        self.decoder = make_session(bundle.onnx_path("decoder"), ["CPUExecutionProvider"], intra_op_threads=threads)
        layers = self.config["n_decoder_layers"]
        kinds = [(i, kind) for i in range(layers) for kind in ("key", "value")]
        self.past = [f"past_{kind}_{i}" for i, kind in kinds]
        self.present = [f"present_{kind}_{i}" for i, kind in kinds]
        self.cross = [f"cross_{kind}_{i}" for i, kind in kinds] + ["cross_mask"]

    def sources(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        ids = [e.ids for e in self.tokenizer.encode_all([SOURCES[i % len(SOURCES)] for i in range(batch)],
                                                          truncate=True)]  # fmt: skip
        longest = max(map(len, ids))
        input_ids = np.zeros((batch, longest), np.int64)
        mask = np.zeros((batch, longest), np.int64)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
        return input_ids, mask

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        shape = (batch, self.config["n_heads"], 0, self.config["head_dim"])
        return {name: np.zeros(shape, np.float32) for name in self.past}

    def run(self, input_ids: np.ndarray, mask: np.ndarray, steps: int, cached: bool) -> np.ndarray:
        """Greedy-decode exactly `steps` tokens; returns them (batch, steps)."""
        batch = len(input_ids)
        cross = dict(zip(self.cross, self.encoder.run(self.cross, {"input_ids": input_ids, "attention_mask": mask}),
                         strict=True))  # fmt: skip
        prefix = np.full((batch, 1), self.bos_id, np.int64)
        past = self.empty(batch)
        for _ in range(steps):
            if cached:
                logits, *presents = self.decoder.run(["logits", *self.present],
                                                     {"input_ids": prefix[:, -1:], **cross, **past})  # fmt: skip
                past = dict(zip(self.past, presents, strict=True))
            else:
                logits = self.decoder.run(["logits"], {"input_ids": prefix, **cross, **self.empty(batch)})[0]
            prefix = np.concatenate([prefix, logits[:, -1].argmax(-1)[:, None]], axis=1)
        return prefix[:, 1:]


def machine() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": model, "platform": platform.platform()}


def versions() -> dict[str, str]:
    return {"python": platform.python_version(),
            **{name: metadata.version(name) for name in ("onnxruntime", "numpy", "sentencepiece")}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "translate-linformer")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads")
    args = parser.parse_args(argv)

    decoder = Decoder(args.bundle, args.threads)
    rows = []
    for batch in args.batches:
        input_ids, mask = decoder.sources(batch)
        for steps in args.steps:
            times: dict[str, list[float]] = {"cache": [], "recompute": []}
            outputs = {}
            decoder.run(input_ids, mask, 4, True)  # warm-up
            for _ in range(args.repeats):  # interleaved: A B A B
                for mode in ("cache", "recompute"):
                    started = time.perf_counter()
                    outputs[mode] = decoder.run(input_ids, mask, steps, mode == "cache")
                    times[mode].append(time.perf_counter() - started)
            same = bool((outputs["cache"] == outputs["recompute"]).all())
            cache_s, recompute_s = statistics.median(times["cache"]), statistics.median(times["recompute"])
            row = {
                "batch": batch, "steps": steps,
                "cache_tokens_per_s": round(batch * steps / cache_s, 1),
                "recompute_tokens_per_s": round(batch * steps / recompute_s, 1),
                "speedup": round(recompute_s / cache_s, 2), "same_tokens": same,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"decode-cache-{args.bundle.name}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    command = "python benchmarks/decode_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info = machine()
    lines = [
        f"# Decoding with the key/value cache vs recomputing the prefix: {args.bundle.name}",
        "",
        f"- Command: `{command.strip()}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {info['cpu']}, nproc {info['nproc']}, {info['platform']}; ONNX Runtime CPU, "
        f"{args.threads} intra-op thread(s)",
        f"- Versions: {versions()}",
        f"- Model: {decoder.config['attention']}, {decoder.config['n_decoder_layers']} decoder layers, "
        f"d_model {decoder.config['n_heads'] * decoder.config['head_dim']}, vocabulary {decoder.config['vocab_size']}",
        f"- Greedy decoding of exactly `steps` tokens per sentence; median of {args.repeats} interleaved repeats; "
        "both modes produce the same tokens (`same_tokens`).",
        "",
        "| batch | steps | cache tokens/s | recompute tokens/s | speedup | same tokens |",
        "|---|---|---|---|---|---|",
        *[f"| {r['batch']} | {r['steps']} | {r['cache_tokens_per_s']} | {r['recompute_tokens_per_s']} | "
          f"{r['speedup']}x | {r['same_tokens']} |" for r in rows],
        "",
    ]  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for batch in args.batches:
            mine = [r for r in rows if r["batch"] == batch]
            steps = [r["steps"] for r in mine]
            ax.plot(steps, [r["cache_tokens_per_s"] for r in mine], "o-", label=f"cache, B={batch}")
            ax.plot(steps, [r["recompute_tokens_per_s"] for r in mine], "s--", label=f"recompute, B={batch}")
        ax.set_xlabel("generated tokens per sentence")
        ax.set_ylabel("tokens / s")
        ax.set_yscale("log")
        ax.set_title(f"{args.bundle.name}: KV cache vs recompute (ORT CPU, {args.threads} thread)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG written", file=sys.stderr)
    print(f"wrote {stem}.csv/.md/.png")


if __name__ == "__main__":
    main()
