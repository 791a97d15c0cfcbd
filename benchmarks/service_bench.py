"""Benchmark the serving stack on a classify bundle; writes CSV + Markdown + PNG (not a test).

(a) service overhead: p50 HTTP latency at one user minus p50 raw `session.run`, 128-token text
    (target <= 1.5 ms);
(b) batching gain: saturated throughput with dynamic batching vs MAX_BATCH_SIZE=1, 64-token texts
    (target >= 2x).

    python benchmarks/service_bench.py [--bundle models/classify-linformer] [--out benchmarks/results]

The server runs as `python -m service` in its own process. The load generator for (b) is wrk (C, one
thread, keep-alive; `apt install wrk`), or without it a small raw asyncio HTTP/1.1 client. Each batching
setting runs at every concurrency and every ORT intra-op thread count given, and the gain compares the
best throughput of each, so batch size 1 gets its best configuration too. On a small machine client and
server share the cores: the report says how many.
"""

import argparse
import asyncio
import csv
import datetime as dt
import http.client
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import free_port, wait_until_ready  # noqa: E402
from service.bundle import Bundle, load_bundle  # noqa: E402
from service.runtime import choose_providers, make_session  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

FILLER = ("the film was a moving story with great music and a brilliant ending but the plot "
          "felt long and the actors were not always convincing").split()


# ---- inputs ----


def text_of_length(tokenizer: Tokenizer, n_tokens: int) -> tuple[str, list[int]]:
    """A text that tokenises to n_tokens (BOS/EOS included) as closely as the vocabulary allows."""
    def count(text: str) -> int:
        return len(tokenizer.encode_all([text], truncate=True)[0].ids)

    words: list[str] = []
    while count(" ".join(words)) < n_tokens and len(words) < 10 * n_tokens:
        words.append(FILLER[len(words) % len(FILLER)])
    while count(" ".join(words)) > n_tokens and len(words) > 1:
        words.pop()
    while count(" ".join(words)) < n_tokens and len(words) < 10 * n_tokens:
        words.append("a")
    text = " ".join(words)
    return text, tokenizer.encode_all([text], truncate=True)[0].ids


# ---- measurements ----


def raw_session_p50_ms(bundle: Bundle, ids: list[int], runs: int) -> float:
    session = make_session(bundle.onnx_path("model"), choose_providers("auto"))
    feeds = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for _ in range(20):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def raw_texts_per_s(bundle: Bundle, ids: list[int], batch: int, threads: int, seconds: float = 3.0) -> float:
    """The model alone, no HTTP: texts/s of back-to-back session.run calls at one batch size."""
    session = make_session(bundle.onnx_path("model"), choose_providers("auto"), intra_op_threads=threads)
    ids_array = np.array([ids] * batch, dtype=np.int64)
    feeds = {"input_ids": ids_array, "attention_mask": np.ones_like(ids_array)}
    for _ in range(5):
        session.run(None, feeds)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(None, feeds)
        runs += 1
    return runs * batch / (time.perf_counter() - started)


class Server:
    def __init__(self, bundle: Bundle, **env: str):
        self.port = free_port()
        environment = {
            **os.environ,
            "LINFORMER_MODELS_DIR": str(bundle.path.parent),
            "LINFORMER_CLASSIFY_MODEL": bundle.path.name,
            "LINFORMER_LOG_LEVEL": "warning",
            **env,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(self.port)], cwd=REPO, env=environment,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            wait_until_ready(self.proc, self.port)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.proc.stderr.read() if self.proc.poll() is not None else ''}") from None

    def metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port)
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def http_one_user_p50_ms(port: int, body: bytes, runs: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"content-type": "application/json"}
    times = []
    for i in range(runs + 20):
        started = time.perf_counter()
        conn.request("POST", "/classify", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        assert response.status == 200, response.status
        if i >= 20:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


async def _client(port: int, request: bytes, stop_at: float, latencies: list[float], errors: list[int]):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        writer.write(request)
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        if status == 200:
            latencies.append(time.perf_counter() - started)
        else:
            errors.append(status)
    writer.close()


def saturated_throughput(port: int, body: bytes, concurrency: int, seconds: float, client: str) -> dict:
    if client == "wrk":
        return wrk_throughput(port, body, concurrency, seconds)
    request = (
        b"POST /classify HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    latencies: list[float] = []
    errors: list[int] = []

    async def run():
        stop_at = time.perf_counter() + seconds
        clients = [_client(port, request, stop_at, latencies, errors) for _ in range(concurrency)]
        await asyncio.gather(*clients)

    started = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - started
    return {
        "throughput_rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "errors": len(errors),
    }


def wrk_throughput(port: int, body: bytes, concurrency: int, seconds: float) -> dict:
    """wrk (C, one thread, keep-alive connections): the load generator takes little of the shared cores."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                     f"wrk.body = {json.dumps(body.decode())}\n")
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "-s", script.name,
             f"http://127.0.0.1:{port}/classify"],
            capture_output=True, text=True, check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    p50 = re.search(r"^\s+50%\s+([\d.]+)(us|ms|s)$", out, re.M)
    return {
        "throughput_rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": float(p50.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)],
        "errors": int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0,
    }


def mean_batch_size(metrics_text: str) -> float:
    values = {}
    for line in metrics_text.splitlines():
        for name in ("linformer_batch_size_sum", "linformer_batch_size_count"):
            if line.startswith(name + "{"):
                values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values.get("linformer_batch_size_sum", 0) / max(values.get("linformer_batch_size_count", 0), 1)


# ---- report ----


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    versions = {name: metadata.version(name) for name in
                ("onnxruntime", "numpy", "fastapi", "uvicorn", "pydantic", "sentencepiece")}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return {"nproc": nproc, "cpu": cpu, "load_before": os.getloadavg()[0],
            "python": platform.python_version(), "platform": platform.platform(), "git_commit": commit,
            **versions}


def write_report(out: Path, stem: str, command: str, bundle: Bundle, info: dict, rows: list[dict],
                 summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{stem}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["measurement", "setting", "concurrency", "value", "unit"])
        writer.writeheader()
        writer.writerows(rows)

    throughput = [r for r in rows if r["measurement"] == "throughput"]
    lines = [
        f"# Service benchmark: {bundle.name}",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{command}`",
        f"- bundle: `{bundle.path}` (name={bundle.name}, attention={bundle.attention}, n_max={bundle.n_max}, "
        f"k={bundle.k}, model.onnx sha256={info['model_sha256'][:16]}...)",
        f"- machine: nproc={info['nproc']}, CPU: {info['cpu']}, {info['platform']}",
        f"- versions: python {info['python']}, "
        + ", ".join(f"{k} {info[k]}" for k in ("onnxruntime", "numpy", "fastapi", "uvicorn", "pydantic")),
        f"- git commit: {info['git_commit']}; load generator for (b): {summary['client']}; it shares the "
        "machine's cores with the server; "
        f"1-min load average before the run: {info['load_before']:.2f}",
        "",
        "## (a) Service overhead at one user",
        "",
        "| text tokens | p50 raw session.run (ms) | p50 HTTP /classify (ms) | overhead (ms) | target |",
        "|---|---|---|---|---|",
        f"| {summary['overhead_tokens']} | {summary['raw_p50_ms']:.3f} | {summary['http_p50_ms']:.3f} | "
        f"{summary['overhead_ms']:.3f} | <= 1.5 ms: {'met' if summary['overhead_ms'] <= 1.5 else 'NOT met'} "
        "|",
        "",
        f"## (b) Batching gain, {summary['throughput_tokens']}-token texts",
        "",
        "| batching | concurrency | throughput (req/s) | p50 latency (ms) | mean batch size | errors |",
        "|---|---|---|---|---|---|",
    ]
    by_key = {(r["setting"], r["concurrency"], r["measurement"]): r["value"] for r in rows}
    for r in throughput:
        key = (r["setting"], r["concurrency"])
        lines.append(
            f"| {r['setting']} | {r['concurrency']} | {r['value']:.1f} | "
            f"{by_key[(*key, 'latency_p50')]:.2f} | "
            f"{by_key[(*key, 'mean_batch_size')]:.2f} | {int(by_key[(*key, 'errors')])} |"
        )
    lines += [
        "",
        "Saturated throughput (best over concurrency and ORT threads): "
        f"dynamic {summary['dynamic_best_rps']:.1f} req/s vs batch size 1 {summary['single_best_rps']:.1f} req/s "
        f"= **{summary['gain']:.2f}x** "
        f"(target >= 2x: {'met' if summary['gain'] >= 2 else 'NOT met'}).",
        "",
        "### What batching can gain here: the model alone (session.run back to back, no HTTP)",
        "",
        "| ORT intra-op threads | batch 1 (texts/s) | batch "
        f"{summary['max_batch_size']} (texts/s) | ratio |",
        "|---|---|---|---|",
        *(f"| {t or 'default'} | {one:.0f} | {many:.0f} | {many / one:.2f} |"
          for t, (one, many) in summary["raw"].items()),
        "",
        f"Ceiling for the service's gain on this machine (best batched over best batch 1): "
        f"**{summary['raw_ceiling']:.2f}x**; the service's {summary['gain']:.2f}x is "
        f"{summary['gain'] / summary['raw_ceiling']:.0%} of it.",
        "",
        f"![results]({stem}.png)",
        "",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(["raw session.run", "HTTP /classify"], [summary["raw_p50_ms"], summary["http_p50_ms"]],
             color=["#888", "#1f77b4"])
    left.set_ylabel("p50 latency (ms)")
    left.set_title(f"(a) one user, {summary['overhead_tokens']} tokens: "
                   f"overhead {summary['overhead_ms']:.2f} ms")
    for setting in dict.fromkeys(r["setting"] for r in throughput):
        points = [(r["concurrency"], r["value"]) for r in throughput if r["setting"] == setting]
        right.plot(*zip(*points, strict=True), "o-" if setting.startswith("dynamic") else "s--", label=setting)
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrent clients")
    right.set_ylabel("throughput (req/s)")
    right.set_title(f"(b) {summary['throughput_tokens']} tokens: gain {summary['gain']:.2f}x")
    right.legend()
    fig.suptitle(f"{bundle.name} ({bundle.attention}), nproc={info['nproc']}, {info['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--runs", type=int, default=300, help="requests for the one-user latency")
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput point")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--max-batch-size", type=int, default=32, help="for the dynamic-batching runs")
    parser.add_argument("--ort-threads", type=int, nargs="+", default=[0, 1], help="ORT intra-op threads (0: default)")
    parser.add_argument("--client", choices=["wrk", "python"], default="wrk" if shutil.which("wrk") else "python",
                        help="load generator for (b): wrk (apt install wrk) or a raw asyncio client")
    args = parser.parse_args()

    if not args.bundle.exists():
        sys.exit(f"no bundle at {args.bundle}: export one first or pass --bundle DIR")
    bundle = load_bundle(args.bundle)
    if bundle.task != "classify":
        sys.exit(f"{args.bundle} is a {bundle.task} bundle; this benchmark needs a classify bundle")
    command = " ".join(["python", *sys.argv])
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    info = {**machine(), "model_sha256": manifest["files"]["model.onnx"]}
    if info["load_before"] > 0.5 * int(info["nproc"]):
        print(f"warning: load average {info['load_before']:.1f} on {info['nproc']} cores: noisy results")
    print(f"benchmarking {bundle.path} ({bundle.attention}, n_max={bundle.n_max}) on nproc={info['nproc']}")

    tokenizer = Tokenizer.from_bundle(bundle)
    overhead_text, overhead_ids = text_of_length(tokenizer, min(128, bundle.n_max))
    load_text, load_ids = text_of_length(tokenizer, min(64, bundle.n_max))
    rows: list[dict] = []

    raw_p50 = raw_session_p50_ms(bundle, overhead_ids, args.runs)
    server = Server(bundle)
    try:
        http_p50 = http_one_user_p50_ms(server.port, json.dumps({"text": overhead_text}).encode(), args.runs)
    finally:
        server.stop()
    rows += [
        {"measurement": "raw_session_run_p50", "setting": f"{len(overhead_ids)} tokens", "concurrency": 1,
         "value": raw_p50, "unit": "ms"},
        {"measurement": "http_classify_p50", "setting": f"{len(overhead_ids)} tokens", "concurrency": 1,
         "value": http_p50, "unit": "ms"},
        {"measurement": "service_overhead_p50", "setting": f"{len(overhead_ids)} tokens", "concurrency": 1,
         "value": http_p50 - raw_p50, "unit": "ms"},
    ]
    print(f"(a) raw p50 {raw_p50:.3f} ms, HTTP p50 {http_p50:.3f} ms, overhead {http_p50 - raw_p50:.3f} ms")

    body = json.dumps({"text": load_text}).encode()
    best = {}
    points = [(batching, batch_size, threads, concurrency)
              for batching, batch_size in (("dynamic", args.max_batch_size), ("max_batch_size=1", 1))
              for threads in args.ort_threads for concurrency in args.concurrency]
    for batching, batch_size, threads, concurrency in points:
        setting = f"{batching}, ORT threads {threads or 'default'}"
        server = Server(bundle, LINFORMER_MAX_BATCH_SIZE=str(batch_size),  # fresh metrics per point
                        LINFORMER_ORT_INTRA_OP_THREADS=str(threads))
        try:
            result = saturated_throughput(server.port, body, concurrency, args.seconds, args.client)
            batch_mean = mean_batch_size(server.metrics())
        finally:
            server.stop()
        print(f"(b) {setting:>36} c={concurrency:<3} {result['throughput_rps']:8.1f} req/s "
              f"p50 {result['p50_ms']:.2f} ms, mean batch {batch_mean:.2f}, errors {result['errors']}")
        best[batching] = max(best.get(batching, 0.0), result["throughput_rps"])
        for measurement, value, unit in (
            ("throughput", result["throughput_rps"], "req/s"), ("latency_p50", result["p50_ms"], "ms"),
            ("mean_batch_size", batch_mean, "texts"), ("errors", result["errors"], "responses"),
        ):
            rows.append({"measurement": measurement, "setting": setting, "concurrency": concurrency,
                         "value": value, "unit": unit})

    raw = {t: (raw_texts_per_s(bundle, load_ids, 1, t), raw_texts_per_s(bundle, load_ids, args.max_batch_size, t))
           for t in args.ort_threads}  # fmt: skip
    for t, (one, many) in raw.items():
        print(f"raw model, ORT threads {t or 'default'}: batch 1 {one:.0f} texts/s, batch {args.max_batch_size} "
              f"{many:.0f} texts/s")
    summary = {
        "max_batch_size": args.max_batch_size, "raw": raw,
        "raw_ceiling": max(many for _, many in raw.values()) / max(one for one, _ in raw.values()),
        "overhead_tokens": len(overhead_ids), "raw_p50_ms": raw_p50, "http_p50_ms": http_p50,
        "overhead_ms": http_p50 - raw_p50, "throughput_tokens": len(load_ids), "client": args.client,
        "dynamic_best_rps": best["dynamic"], "single_best_rps": best["max_batch_size=1"],
        "gain": best["dynamic"] / best["max_batch_size=1"],
    }
    stem = f"service_bench_{bundle.name}"
    write_report(args.out, stem, command, bundle, info, rows, summary)
    print(f"gain {summary['gain']:.2f}x; wrote {args.out / stem}.{{csv,md,png}}")


if __name__ == "__main__":
    main()
