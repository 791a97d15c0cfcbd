"""The serving stack against its own model and against the peers, in one run per text length (issue #20).

For each text length (16, 64, 512 tokens by default), side by side on one machine:
- the model alone: `session.run` back to back at batch sizes 1-32 (texts/s, CPU per text), and its batch-1
  latency, on core 0 with one ORT thread;
- this service (`python -m service`, its defaults: the bundle's measured token budget, max batch 32, no batch
  wait) at 1, 16 and 64 keep-alive connections: req/s, p50, p99, server CPU per request and the part of it
  outside `session.run` (server CPU minus the model's CPU per text at the mean batch size the server formed);
- the same bundle, tokenizer and session settings behind Mosec and Triton's dynamic batcher (PyTriton),
  each configured per its docs for the lowest latency (max batch 32, smallest wait), from the `[peers]`
  extra installed in its own venv (`--peers-python`; they pin numpy < 2);
- the floor (`benchmarks/peers/floor_classify.py`, `--no-floor` to leave it out): a bare uvloop HTTP server that
  does no per-request work but `session.run` on batches of the model alone's best size, what serving costs on this
  core before any request work; each goal's line says where the floor stands against it (not a strict bound: at
  512 tokens the service once served more than it, benchmarks/results/service-bench-session31/).

Every server runs pinned to core 0 with one ORT thread; the load generator (wrk, one thread, keep-alive, one
text per request; `apt install wrk`) runs on core 1. At each concurrency the servers take turns (service,
floor, Mosec, Triton), each warmed up at that concurrency first, so the comparison is interleaved in time; with
`--turns N` they take N turns, the order reversed every other turn, and each figure is the median of its turns.

    python benchmarks/service_bench.py --bundle models/classify-linformer [--tokens 16 64 512] [--seconds 8]
                                       [--turns 1]
    make bench-service

Writes benchmarks/results/service_bench_<bundle>[-<tokens>].{csv,md,png}. `--flame` also records a py-spy
flame graph of the service at 64 connections (64 tokens) into service_flame_<bundle>.{svg,png}.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import http.client
import json
import math
import operator
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loadgen import free_port, main_thread_cpu_s, pin_to, service_at  # noqa: E402
from loadtest.report import agg_subplots, save_figure, write_markdown  # noqa: E402
from service.bundle import Bundle, load_bundle  # noqa: E402
from service.runtime import CPU, make_session  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

FILLER = ("the film was a moving story with great music and a brilliant ending but the plot "
          "felt long and the actors were not always convincing").split()
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SERVER_CORE, LOAD_CORE = "0", "1"


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


# ---- the model alone ----


def model_alone(bundle: Bundle, ids: list[int], seconds: float) -> dict:
    """On the servers' core, one ORT thread, the service's session settings (its classifier's, service/app.py:
    ORT's CPU arena and memory patterns on; the service gives a big batch's memory back only once idle, never
    between back-to-back runs):
    texts/s and CPU ms per text at each batch size, and the batch-1 p50 latency."""
    pin_to({int(SERVER_CORE)})
    session = make_session(bundle.onnx_path("model"), [CPU], intra_op_threads=1, inter_op_threads=1,
                           cpu_mem_arena=True)  # fmt: skip
    rates, cpu_ms = {}, {}
    for batch in BATCH_SIZES:
        array = np.array([ids] * batch, dtype=np.int64)
        feeds = {"input_ids": array, "attention_mask": np.ones_like(array)}
        for _ in range(3):
            session.run(None, feeds)
        runs, started, cpu_started = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            session.run(None, feeds)
            runs += 1
        rates[batch] = runs * batch / (time.perf_counter() - started)
        cpu_ms[batch] = (time.process_time() - cpu_started) / (runs * batch) * 1000
    array = np.array([ids], dtype=np.int64)
    feeds = {"input_ids": array, "attention_mask": np.ones_like(array)}
    times = []
    for _ in range(max(50, int(seconds * rates[1]))):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    pin_to({int(LOAD_CORE)})
    best = max(rates, key=rates.get)
    return {"rates": rates, "cpu_ms": cpu_ms, "best_batch": best, "best_rate": rates[best],
            "batch1_p50_ms": statistics.median(times) * 1000}  # fmt: skip


def best_of(first: dict, second: dict) -> dict:
    rates = {b: max(first["rates"][b], second["rates"][b]) for b in first["rates"]}
    cpu_ms = {b: min(first["cpu_ms"][b], second["cpu_ms"][b]) for b in first["cpu_ms"]}
    best = max(rates, key=rates.get)
    return {"rates": rates, "cpu_ms": cpu_ms, "best_batch": best, "best_rate": rates[best],
            "batch1_p50_ms": min(first["batch1_p50_ms"], second["batch1_p50_ms"])}  # fmt: skip


def model_cpu_ms_at(model: dict, mean_batch: float) -> float:
    """The model's CPU per text at a mean batch size, interpolated between the measured sizes."""
    sizes = sorted(model["cpu_ms"])
    return float(np.interp(mean_batch, sizes, [model["cpu_ms"][b] for b in sizes]))


# ---- servers ----


@dataclass
class Server:
    """One server process tree on core 0 and what the load generator sends it."""

    name: str
    command: list[str]
    env: dict[str, str]
    path: str  # the route the load goes to
    body: bytes
    ready_path: str
    batch_metrics: tuple[str, str] | None = None  # (texts, batches) counters in its Prometheus /metrics
    # this service's: seconds its runtime ran on the main thread (a lone short text, service/batcher.py INLINE_MAX_S)
    inline_metric: str | None = None
    metrics_port: int | None = None  # None: the HTTP port
    cwd: Path = REPO
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self, log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        command = [part.format(port=self.port) for part in self.command]
        self.proc = subprocess.Popen(["taskset", "-c", SERVER_CORE, *command], cwd=self.cwd,
                                     env={**os.environ, **self.env}, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not become ready; see {log}")

    def cpu_seconds(self) -> tuple[float, float]:
        """(user + system, system) CPU of the whole process tree (Mosec and Triton run several processes)."""
        root = psutil.Process(self.proc.pid)
        total = system = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
                system += times.system
            except psutil.NoSuchProcess:
                pass
        return total, system

    def main_thread_cpu_seconds(self) -> float:
        """User + system CPU of the root process's main thread (`main_thread_cpu_s`); the rest of the tree makes up
        the difference."""
        return main_thread_cpu_s(self.proc.pid)

    def counters(self) -> tuple[float, float, float]:
        """(texts, batches, runtime seconds on the main thread) so far, from the server's own metrics (0 if none)."""
        if self.batch_metrics is None:
            return 0.0, 0.0, 0.0
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port or self.port)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()

        def total(name: str | None) -> float:
            return sum(float(line.split()[-1]) for line in text.splitlines() if name and line.startswith(name))

        sum_name, count_name = self.batch_metrics
        return total(sum_name), total(count_name), total(self.inline_metric)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        if self.proc is not None:  # started (a server after one that failed to start never was)
            self._log.close()


FLOOR = "floor (no request work)"


def make_servers(bundle: Bundle, text: str, peers: list[str], peers_python: str,
                 baselines: list[tuple[str, Path, dict[str, str]]],
                 floor_batch: int | None) -> list[Server]:  # fmt: skip
    """`floor_batch`: serve the floor too, in batches of at most this many texts (None: not)."""
    service_env = {
        "LINFORMER_MODELS_DIR": str(bundle.path.resolve().parent), "LINFORMER_CLASSIFY_MODEL": bundle.path.name,
        "LINFORMER_TRANSLATE_MODEL": "", "LINFORMER_LOG_LEVEL": "warning",
        "LINFORMER_ORT_INTRA_OP_THREADS": "1", "LINFORMER_ORT_INTER_OP_THREADS": "1",
        # the peers queue every request (Mosec's capacity is 1,024): admit all 64 connections here too
        "LINFORMER_MAX_CONCURRENT_REQUESTS": "256",
    }  # fmt: skip
    servers = [Server("this service", [sys.executable, "-m", "service", "--port", "{port}"], service_env, "/classify",
                      json.dumps({"text": text}).encode(), "/readyz",
                      ("linformer_batch_size_sum", "linformer_batch_size_count"),
                      inline_metric="linformer_inline_inference_seconds_total")]  # fmt: skip
    ours = servers[0]
    for ref, checkout, env in baselines:  # the service as it was at an earlier commit, same settings (+ env)
        settings = "".join(f", {key.removeprefix('LINFORMER_')}={value}" for key, value in env.items())
        name = f"service at {ref}{settings}"
        servers.append(Server(name, list(ours.command), {**service_env, **env}, ours.path, ours.body,
                              ours.ready_path, ours.batch_metrics, ours.inline_metric, cwd=checkout))  # fmt: skip
    if floor_batch is not None:
        servers.append(Server(
            FLOOR, [sys.executable, "benchmarks/peers/floor_classify.py", "--bundle", str(bundle.path), "--port",
                    "{port}", "--max-batch", str(floor_batch)],
            {}, "/classify", ours.body, "/", ("floor_batch_size_sum", "floor_batch_size_count"),
        ))  # fmt: skip
    peer_env = {"LINFORMER_BUNDLE": str(bundle.path), "OMP_NUM_THREADS": "1"}
    if "mosec" in peers:
        servers.append(Server(
            "Mosec", [peers_python, "benchmarks/peers/mosec_classify.py", "--port", "{port}"],
            peer_env, "/inference", json.dumps({"text": text}).encode(), "/",
            ("mosec_service_batch_size_sum", "mosec_service_batch_size_count"),
        ))  # fmt: skip
    if "triton" in peers:
        # the Python backend's stub must load the libpython of the interpreter that runs PyTriton
        libdir = subprocess.run([peers_python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
        server = Server(
            "Triton (PyTriton)", [peers_python, "benchmarks/peers/triton_classify.py", "--port", "{port}"],
            {**peer_env, "LD_LIBRARY_PATH": libdir}, "/v2/models/classify/infer", json.dumps(body).encode(),
            "/v2/models/classify/ready",
        )  # fmt: skip
        server.port = free_port_block(3)  # HTTP, gRPC, metrics
        server.metrics_port = server.port + 2
        server.batch_metrics = ("nv_inference_request_success", "nv_inference_exec_count")
        servers.append(server)
    return servers


def free_port_block(n: int) -> int:
    while True:
        port = free_port()
        if port + n < 65536 and all(_is_free(port + i) for i in range(1, n)):
            return port


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# ---- load ----


def wrk(server: Server, connections: int, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                     f"wrk.body = {json.dumps(server.body.decode())}\n")
    try:
        out = subprocess.run(
            ["taskset", "-c", LOAD_CORE, "wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency",
             "--timeout", "30s", "-s", script.name, f"http://127.0.0.1:{server.port}{server.path}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(script.name)

    def quantile(q: int) -> float:  # NaN when nothing was answered
        found = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s|m)$", out, re.M)
        if found is None:
            return math.nan
        return float(found.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[found.group(2)]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    non_2xx = int(errors.group(1)) if errors else 0
    socket_errors = re.search(r"Socket errors: (.*)$", out, re.M)
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return {"requests": requests, "rps": rps * (requests - non_2xx) / max(requests, 1),  # answered ones only
            "p50_ms": quantile(50), "p99_ms": quantile(99), "non_2xx": non_2xx,
            "socket_errors": socket_errors.group(1).strip() if socket_errors else ""}  # fmt: skip


def measure(server: Server, connections: int, seconds: float, model: dict) -> dict:
    wrk(server, connections, min(3.0, seconds))  # warm up at the measured concurrency
    texts0, batches0, inline0 = server.counters()
    (cpu0, kernel0), loop0 = server.cpu_seconds(), server.main_thread_cpu_seconds()
    result = wrk(server, connections, seconds)
    (cpu1, kernel1), loop1 = server.cpu_seconds(), server.main_thread_cpu_seconds()
    texts1, batches1, inline1 = server.counters()
    mean_batch = (texts1 - texts0) / (batches1 - batches0) if batches1 > batches0 else float("nan")
    cpu_ms = (cpu1 - cpu0) / max(result["requests"], 1) * 1000
    kernel_ms = (kernel1 - kernel0) / max(result["requests"], 1) * 1000
    # the event loop's own CPU: the main thread's less the runtime calls it made itself (a lone short text)
    loop_ms = (loop1 - loop0 - (inline1 - inline0)) / max(result["requests"], 1) * 1000
    row = {"server": server.name, "connections": connections, **result, "mean_batch": mean_batch,
           "cpu_ms_per_request": cpu_ms, "kernel_cpu_ms": kernel_ms, "main_thread_cpu_ms": loop_ms,
           "ratio_to_model": result["rps"] / model["best_rate"]}  # fmt: skip
    return {**row, "cpu_ms_outside_run": cpu_ms_outside_run(row, model)}


def median_row(turns: list[dict]) -> dict:
    """One server's turns at one concurrency as one row: each figure's median (requests and non-2xx summed)."""
    row = dict(turns[0])
    for key, value in row.items():
        if key in ("requests", "non_2xx"):
            row[key] = sum(turn[key] for turn in turns)
        elif isinstance(value, float | int) and key != "connections":
            row[key] = statistics.median(turn[key] for turn in turns)
    row["socket_errors"] = "; ".join(turn["socket_errors"] for turn in turns if turn["socket_errors"])
    return row


def take_turns(servers: list[Server], connections: int, turns: int, seconds: float, model: dict,
               show: Callable[[Server, dict], None]) -> dict[str, list[dict]]:  # fmt: skip
    """The servers measured at one concurrency `turns` times each, taking turns (the order reversed every other turn,
    so that a drift of the core's speed falls on all), each turn's row shown as it comes: server name -> its rows."""
    rows: dict[str, list[dict]] = {server.name: [] for server in servers}
    for turn in range(turns):
        for server in servers if turn % 2 == 0 else servers[::-1]:
            row = measure(server, connections, seconds, model)
            rows[server.name].append(row)
            show(server, row)
    return rows


def cpu_ms_outside_run(row: dict, model: dict) -> float:
    """The server's CPU per request minus the model's CPU per text at the mean batch size it formed, and for this
    service at least its event loop's CPU (its main thread's, less the session.run calls it made itself): the
    model's figure is measured alone, seconds away, on a VM whose speed drifts, and a slower spell there made the
    difference negative (-0.094 ms at 64 connections, judged met, against 0.216 ms of event loop per request)."""
    if row["mean_batch"] != row["mean_batch"]:  # NaN: no batch counted
        return float("nan")
    estimate = row["cpu_ms_per_request"] - model_cpu_ms_at(model, row["mean_batch"])
    return max(estimate, row["main_thread_cpu_ms"]) if main_thread_is_event_loop(row) else estimate


def record_flame(server: Server, out: Path, seconds: float, native: bool = False) -> None:
    """py-spy on the service at 64 connections (not during a measured run: sampling costs the server CPU).
    `native` adds the C/C++ frames (ONNX Runtime, SentencePiece, uvloop); py-spy must then stop the process for
    each sample, so it samples less often."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    svg = out.with_suffix(".svg")
    sampling = ["--native", "-r", "100"] if native else ["-r", "250", "--nonblocking"]
    recorder = subprocess.Popen([py_spy, "record", "-p", str(server.proc.pid), "-o", str(svg), "-d", f"{seconds:g}",
                                 "--threads", *sampling], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrk(server, 64, seconds)
    recorder.wait()
    if shutil.which("rsvg-convert") and svg.exists():  # apt install librsvg2-bin
        subprocess.run(["rsvg-convert", "-w", "1600", "-b", "white", "-o", str(out.with_suffix(".png")), str(svg)],
                       check=True)  # fmt: skip


# ---- report ----


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    versions = {name: metadata.version(name) for name in
                ("onnxruntime", "numpy", "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "pydantic",
                 "sentencepiece")}  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split("[")[0].strip()
    return {"nproc": os.cpu_count(), "cpu": cpu, "load_before": os.getloadavg(), "python": platform.python_version(),
            "platform": platform.platform(), "git_commit": commit, "wrk": wrk_version, **versions}  # fmt: skip


def peer_versions(peers_python: str) -> dict:
    code = ("import json; from importlib.metadata import version as v; "
            "print(json.dumps({n: v(n) for n in ('mosec', 'nvidia-pytriton', 'onnxruntime', 'numpy')}))")
    found = subprocess.run([peers_python, "-c", code], capture_output=True, text=True)
    return json.loads(found.stdout) if found.returncode == 0 else {}


def write_report(out: Path, stem: str, command: str, bundle: Bundle, info: dict, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["tokens", "server", "connections", "rps", "p50_ms", "p99_ms", "cpu_ms_per_request",
              "cpu_ms_outside_run", "kernel_cpu_ms", "main_thread_cpu_ms", "mean_batch", "ratio_to_model", "requests",
              "non_2xx", "socket_errors"]
    with (out / f"{stem}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for tokens, per_length in results.items():
            model = per_length["model"]
            for batch in BATCH_SIZES:
                writer.writerow({"tokens": tokens, "server": f"model alone, batch {batch}", "connections": "",
                                 "rps": round(model["rates"][batch], 1), "cpu_ms_per_request":
                                 round(model["cpu_ms"][batch], 4), "mean_batch": batch,
                                 "p50_ms": round(model["batch1_p50_ms"], 4) if batch == 1 else ""})  # fmt: skip
            for row in per_length["rows"]:
                writer.writerow({"tokens": tokens, **{k: round(v, 4) if isinstance(v, float) else v
                                                      for k, v in row.items()}})  # fmt: skip

    peers = info.get("peers", {})
    lines = [
        f"# The serving stack against its model and its peers: {bundle.name}",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{command}`",
        f"- bundle: `{bundle.path}` ({bundle.attention}, n_max={bundle.n_max}, k={bundle.k}; the service's token "
        f"budget from its manifest: {bundle.max_batch_tokens or 'none (16384)'})",
        f"- machine: {info['nproc']} cores, {info['cpu']}, {info['platform']}; 1/5/15-min load average before "
        f"the run: {'/'.join(f'{x:.2f}' for x in info['load_before'])}, after: "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- versions: python {info['python']}, " + ", ".join(
            f"{k} {info[k]}" for k in ("onnxruntime", "numpy", "fastapi", "starlette", "uvicorn", "uvloop",
                                       "httptools", "pydantic", "sentencepiece")) + f"; {info['wrk']}; peers' venv: "
        + (", ".join(f"{k} {v}" for k, v in peers.items()) or "not installed"),
        f"- git commit: {info['git_commit']}",
        "- set-up: every server on core 0 with one ORT intra- and inter-op thread, the same tokenizer, session "
        "settings and softmax; wrk (1 thread, keep-alive, one text per request) on core 1; at each concurrency the "
        f"servers take turns ({info['turns']} turn(s), the order reversed every other turn; each figure the median "
        "of its turns), each warmed up at that concurrency first. Service: its defaults (max batch 32, no "
        "batch wait, the bundle's measured token budget), log level warning. Mosec: one worker, max_batch_size 32, "
        "max_wait_time 1 ms (its smallest). Triton: PyTriton, max_batch_size 32, max_queue_delay_microseconds 0. "
        "The floor (`benchmarks/peers/floor_classify.py`): no per-request work but `session.run`, on the event loop, "
        "in batches of at most the model alone's best size at that length (its first measurement in the run).",
        "- CPU outside session.run: the server's CPU (whole process tree) per request minus the model's CPU per "
        "text at the mean batch size that server formed (from its own metrics), as measured alone in this run; "
        "for this service at least its event loop's CPU (the model "
        "alone is measured seconds away on a VM whose speed drifts, and a slower spell there can make the "
        "difference smaller than the loop's own CPU, even negative). Main thread CPU: the part on the server "
        "process's main thread (this service: the event loop, less the session.run calls it makes itself for a "
        "lone short text, from its metrics; the rest is its inference thread, session.run included). Kernel: the "
        "system part of the server's CPU per request (socket reads and writes, epoll, futexes, scheduling; the network "
        "softirq work, on loopback the receiving side's TCP processing, is the machine's time, not the process's).",
        "",
    ]
    for tokens, per_length in results.items():
        model = per_length["model"]
        lines += [
            f"## {tokens}-token texts",
            "",
            "Model alone (session.run back to back): "
            + ", ".join(f"batch {b}: {model['rates'][b]:.0f} texts/s ({model['cpu_ms'][b]:.3f} ms CPU/text)"
                        for b in BATCH_SIZES)
            + f". Best: batch {model['best_batch']}, **{model['best_rate']:.0f} texts/s**; batch-1 p50 latency "
            f"**{model['batch1_p50_ms']:.3f} ms**.",
            "",
            "| server | connections | req/s | / model alone | p50 (ms) | p99 (ms) | CPU/request (ms) | "
            "CPU outside session.run (ms) | kernel (ms) | main thread CPU (ms) | mean batch | non-2xx | "
            "socket errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in per_length["rows"]:
            lines.append(
                f"| {row['server']} | {row['connections']} | {row['rps']:.0f} | {row['ratio_to_model']:.2f} | "
                f"{row['p50_ms']:.2f} | {row['p99_ms']:.1f} | {row['cpu_ms_per_request']:.3f} | "
                f"{row['cpu_ms_outside_run']:.3f} | {row['kernel_cpu_ms']:.3f} | {main_thread_cell(row)} | "
                f"{row['mean_batch']:.1f} | "
                f"{row['non_2xx']} | {row['socket_errors'] or '-'} |"
            )
        lines.append("")
    lines += ["## Goals (issue #20)", "", *goals(results), "", f"![results]({stem}.png)", ""]
    write_markdown(out / f"{stem}.md", lines, echo=False)
    plot(out / f"{stem}.png", bundle, info, results)


def main_thread_is_event_loop(row: dict) -> bool:
    """Only this service's main thread is one part of its work (the event loop, its baselines' too); the peers' are
    not, and the floor's runs its model as well."""
    return row["server"] == "this service" or row["server"].startswith("service at ")


def main_thread_cell(row: dict) -> str:
    return f"{row['main_thread_cpu_ms']:.3f}" if main_thread_is_event_loop(row) else "-"


def goals(results: dict) -> list[str]:
    def row(tokens: int, server: str, connections: int) -> dict | None:
        return next((r for r in results.get(tokens, {}).get("rows", [])
                     if r["server"] == server and r["connections"] == connections), None)  # fmt: skip

    def verdict(met: bool) -> str:
        return "**met**" if met else "**missed**"

    def floor(tokens: int, connections: int, figure: Callable[[dict], float], met: Callable[[float], bool],
              unit: str = "") -> str:  # fmt: skip
        """Where the floor stands against the same goal, if it ran."""
        if (r := row(tokens, FLOOR, connections)) is None:
            return ""
        value = figure(r)
        return f"; the floor {value:.3f}{unit}, " + ("within the goal" if met(value) else "**outside it too**")

    lines = []
    ours = "this service"
    if (r := row(64, ours, 64)) is not None:
        lines.append(f"- 64 tokens, 64 connections: {r['ratio_to_model']:.2f} of the model alone at its best batch "
                     f"size (goal >= 0.85): {verdict(r['ratio_to_model'] >= 0.85)}"
                     + floor(64, 64, operator.itemgetter("ratio_to_model"), lambda v: v >= 0.85))  # fmt: skip
        for connections in (16, 64):
            mine = row(64, ours, connections)
            for peer in ("Mosec", "Triton (PyTriton)"):
                theirs = row(64, peer, connections)
                if mine is None or theirs is None:
                    continue
                met = mine["rps"] > theirs["rps"] and mine["p99_ms"] <= theirs["p99_ms"]
                lines.append(f"- 64 tokens, {connections} connections, against {peer}: {mine['rps']:.0f} vs "
                             f"{theirs['rps']:.0f} req/s ({mine['rps'] / theirs['rps']:.2f}x), p99 "
                             f"{mine['p99_ms']:.1f} vs {theirs['p99_ms']:.1f} ms: {verdict(met)}")
    for tokens, per_length in results.items():
        if (r := row(tokens, ours, 1)) is not None:
            batch1 = per_length["model"]["batch1_p50_ms"]

            def overhead(r: dict, batch1: float = batch1) -> float:
                return r["p50_ms"] - batch1

            lines.append(f"- {tokens} tokens, 1 connection: p50 {r['p50_ms']:.3f} ms against the model's batch-1 "
                         f"{batch1:.3f} ms + 0.3 = {batch1 + 0.3:.3f} ms: {verdict(overhead(r) <= 0.3)} (overhead "
                         f"{overhead(r):.3f} ms" + floor(tokens, 1, overhead, lambda v: v <= 0.3, " ms") + ")")
    for tokens in results:
        if (r := row(tokens, ours, 64)) is not None:
            lines.append(f"- {tokens} tokens, 64 connections: CPU outside session.run {r['cpu_ms_outside_run']:.3f} "
                         f"ms per request (goal <= 0.15 ms): {verdict(r['cpu_ms_outside_run'] <= 0.15)}"
                         + floor(tokens, 64, operator.itemgetter("cpu_ms_outside_run"), lambda v: v <= 0.15,
                                 " ms"))  # fmt: skip
    if (r := row(512, ours, 64)) is not None:
        lines.append(f"- 512 tokens, 64 connections: {r['ratio_to_model']:.2f} of the model alone at its best batch "
                     f"size (goal >= 0.95): {verdict(r['ratio_to_model'] >= 0.95)}"
                     + floor(512, 64, operator.itemgetter("ratio_to_model"), lambda v: v >= 0.95))  # fmt: skip
    return lines


def plot(path: Path, bundle: Bundle, info: dict, results: dict) -> None:
    fig, axes = agg_subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (tokens, per_length) in zip(axes[0], results.items(), strict=True):
        servers = list(dict.fromkeys(r["server"] for r in per_length["rows"]))
        connections = sorted({r["connections"] for r in per_length["rows"]})
        width = 0.8 / max(len(servers), 1)
        for i, server in enumerate(servers):
            values = [next((r["rps"] for r in per_length["rows"] if r["server"] == server and r["connections"] == c),
                           0) for c in connections]  # fmt: skip
            ax.bar(np.arange(len(connections)) + i * width, values, width, label=server)
        ax.axhline(per_length["model"]["best_rate"], color="k", ls="--", lw=1,
                   label=f"model alone, batch {per_length['model']['best_batch']}")  # fmt: skip
        ax.set_xticks(np.arange(len(connections)) + width * (len(servers) - 1) / 2, [str(c) for c in connections])
        ax.set_xlabel("keep-alive connections")
        ax.set_ylabel("requests/s (one text each)")
        ax.set_title(f"{tokens}-token texts")
        ax.legend(fontsize=7)
    fig.suptitle(f"{bundle.name} on core 0, 1 ORT thread; {info['cpu']}", fontsize=9)
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="per measured point (after a warm-up)")
    parser.add_argument("--turns", type=int, default=1, help="measure each point this many times, the servers taking "
                        "turns (the order reversed every other turn), and report each figure's median: an effect of "
                        "tens of microseconds is within a VM's drift between two single turns")  # fmt: skip
    parser.add_argument("--peers", nargs="*", default=["mosec", "triton"], choices=["mosec", "triton"])
    parser.add_argument("--peers-python", default=str(REPO / ".venv-peers" / "bin" / "python"),
                        help="a venv with `pip install -e '.[peers]'` (Mosec, PyTriton)")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="leave out the floor (benchmarks/peers/floor_classify.py)")
    parser.add_argument("--flame", action="store_true", help="also record a py-spy flame graph of the service")
    parser.add_argument("--baseline", metavar="GIT_REF[,KEY=VALUE...]", nargs="*", default=[],
                        help="also serve with service/ as it was at these commits (git archive), for a before/after, "
                        "each with LINFORMER_* settings of its own (e.g. 0cd131b,LINFORMER_MAX_BATCH_TOKENS=128)")
    args = parser.parse_args()

    if shutil.which("wrk") is None:
        sys.exit("wrk is needed (apt install wrk)")
    bundle = load_bundle(args.bundle)
    if bundle.task != "classify":
        sys.exit(f"{args.bundle} is a {bundle.task} bundle; this benchmark needs a classify bundle")
    peers = args.peers if Path(args.peers_python).exists() else []
    if args.peers and not peers:
        print(f"no peers' venv at {args.peers_python}: measuring the service alone")
    info = {**machine(), "peers": peer_versions(args.peers_python) if peers else {}, "turns": args.turns}
    command = " ".join(["python", *[str(Path(a).relative_to(REPO)) if a.startswith(str(REPO)) else a
                                    for a in sys.argv]])  # fmt: skip
    tokenizer = Tokenizer.from_bundle(bundle)
    pin_to({int(LOAD_CORE)})
    logs = Path(tempfile.mkdtemp(prefix="service-bench-"))
    baselines = []
    for index, spec in enumerate(args.baseline):
        ref, *assignments = spec.split(",")
        checkout = service_at(ref, logs / f"baseline-{index}")
        baselines.append((ref, checkout, dict(assignment.split("=", 1) for assignment in assignments)))
    results: dict[int, dict] = {}
    for tokens in args.tokens:
        text, ids = text_of_length(tokenizer, min(tokens, bundle.n_max))
        model = model_alone(bundle, ids, seconds=min(2.0, args.seconds))
        print(f"{len(ids)} tokens, model alone: " + ", ".join(f"b{b} {r:.0f}/s" for b, r in model["rates"].items())
              + f"; batch-1 p50 {model['batch1_p50_ms']:.3f} ms", flush=True)  # fmt: skip
        servers = make_servers(bundle, text, peers, args.peers_python, baselines,
                               floor_batch=model["best_batch"] if args.floor else None)  # fmt: skip
        rows = []
        try:
            for server in servers:
                server.start(logs / f"{server.name.split()[0].lower()}-{tokens}.log")
            for connections in args.connections:

                def show(server: Server, row: dict, tokens: int = len(ids), connections: int = connections) -> None:
                    print(f"{tokens} tokens, {server.name:>18}, c={connections:<3} {row['rps']:7.0f} req/s "
                          f"({row['ratio_to_model']:.2f} of model) p50 {row['p50_ms']:7.2f} p99 "
                          f"{row['p99_ms']:7.1f} ms, CPU/req {row['cpu_ms_per_request']:.3f} (outside run "
                          f"{row['cpu_ms_outside_run']:.3f}, kernel {row['kernel_cpu_ms']:.3f}) ms, batch "
                          f"{row['mean_batch']:.1f}, non-2xx {row['non_2xx']}, socket errors "
                          f"{row['socket_errors'] or 'none'}", flush=True)  # fmt: skip

                turns = take_turns(servers, connections, args.turns, args.seconds, model, show)
                rows += [median_row(turns[server.name]) for server in servers]
            if args.flame and tokens in (64, 512):  # 512: native frames too, to see inside session.run
                suffix = "" if tokens == 64 else f"-{tokens}-native"
                record_flame(servers[0], args.out / f"service_flame_{bundle.name}{suffix}", args.seconds,
                             native=tokens == 512)  # fmt: skip
        finally:
            for server in servers:
                server.stop()
        # the model again after the servers, each batch size at the faster of its two runs: the ratios are taken
        # against the model's best showing in this run
        again = model_alone(bundle, ids, seconds=min(2.0, args.seconds))
        model = best_of(model, again)
        for row in rows:
            row["ratio_to_model"] = row["rps"] / model["best_rate"]
            row["cpu_ms_outside_run"] = cpu_ms_outside_run(row, model)
        results[len(ids)] = {"model": model, "rows": rows}
    suffix = "" if args.tokens == [16, 64, 512] else "-" + "-".join(map(str, args.tokens))
    stem = f"service_bench_{bundle.name}{suffix}"
    write_report(args.out, stem, command, bundle, info, results)
    print("\n".join(goals(results)))
    print(f"wrote {args.out / stem}.{{csv,md,png}} (server logs in {logs})")


if __name__ == "__main__":
    main()
