"""The event loop's CPU per /classify request, in-process: the service's ASGI app without sockets (issue #20).

    python benchmarks/request_loop.py [--tokens 16 64 512] [--baseline REF[,KEY=VALUE...] ...]

Each measurement is a child process pinned to core 0 that builds the app as `python -m service` does (its
Settings from LINFORMER_* variables, the bundle's measured token budget, one ORT thread; logging configured as
service/__main__.py does, into a file) and drives it with `--concurrency` concurrent requests of one text each,
straight into the ASGI app (the request middleware, POST /classify, the batcher, the runtime). It reports the
CPU time of the event-loop thread per request (what the request path costs the loop, without uvicorn's protocol
and the kernel's socket work) and of the whole process (the inference thread and `session.run` included).
`--no-model`: the classifier's `run` answers zeros without calling ONNX Runtime (the bundle still loads), so
what is measured is the request path alone, the batcher's trip to its compute thread and back included, free of
the model's own run-to-run noise. The service's code comes from the working tree or, for `--baseline REF`, from
`git archive REF service` (with LINFORMER_* settings of its own after the ref; `.` is the working tree, e.g.
`.,LINFORMER_LOG_LEVEL=info`). Variants take turns within each round, so a comparison is interleaved in time;
the medians over the rounds go to request_loop_<bundle>[-no-model].{csv,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)


class _NoModel:
    """A classifier runtime's stand-in for --no-model: logits of zeros, no session.run."""

    def __init__(self, runtime):
        self.runtime = runtime

    def run(self, input_ids, attention_mask):
        return np.zeros((len(input_ids), 2), np.float32)

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)


def child(code_dir: Path, body: bytes, requests: int, concurrency: int, no_model: bool = False) -> dict:
    """Runs in the measuring process: the app from `code_dir`, driven in-process; -> CPU per request."""
    sys.path.insert(0, str(code_dir))
    os.sched_setaffinity(0, {0})
    import uvloop

    import service
    from service.app import create_app
    from service.config import Settings

    if not Path(service.__file__).is_relative_to(code_dir):
        raise RuntimeError(f"measuring {service.__file__}, not the service in {code_dir}")

    settings = Settings()
    log_file = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115  (the server's stderr)
    try:
        from service.__main__ import configure_logging
    except ImportError:  # a baseline from before configure_logging: what its __main__ did
        logging.basicConfig(level=settings.log_level.upper(), stream=log_file,
                            format="time=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")  # fmt: skip
    else:
        configure_logging(settings, log_file)
    app = create_app(settings, wrap_runtime=_NoModel if no_model else None)
    headers = [(b"host", b"service"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip

    async def one_request() -> None:
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        answered = asyncio.Event()
        statuses = []

        async def receive() -> dict:  # as uvicorn's: the body, then http.disconnect once the answer is sent
            if pending:
                return pending.pop()
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/classify", "raw_path": b"/classify", "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
                 "state": {}}  # fmt: skip
        await app(scope, receive, send)
        answered.set()
        if statuses != [200]:
            raise RuntimeError(f"the service answered {statuses}")

    latencies: list[float] = []

    async def client(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await one_request()
            latencies.append(time.perf_counter() - started)

    async def drive() -> dict:
        async with app.router.lifespan_context(app):
            await asyncio.gather(*(client(50) for _ in range(concurrency)))  # warm-up
            latencies.clear()
            per_client = requests // concurrency
            loop_started, process_started, started = time.thread_time(), time.process_time(), time.perf_counter()
            await asyncio.gather(*(client(per_client) for _ in range(concurrency)))
            loop_s, process_s = time.thread_time() - loop_started, time.process_time() - process_started
            elapsed = time.perf_counter() - started
            done = per_client * concurrency
            return {"loop_us": loop_s / done * 1e6, "process_us": process_s / done * 1e6, "rps": done / elapsed,
                    "p50_us": statistics.median(latencies) * 1e6}  # fmt: skip

    result = uvloop.run(drive())
    os.unlink(log_file.name)
    return result


def measure(
    code_dir: Path, env: dict[str, str], body_file: Path, requests: int, concurrency: int, no_model: bool
) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(code_dir), str(body_file), str(requests), str(concurrency),
         str(int(no_model))],
        env={**os.environ, **env}, capture_output=True, text=True, check=True, cwd=code_dir,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        code_dir, body_file, requests, concurrency, no_model = sys.argv[2:7]
        result = child(Path(code_dir), Path(body_file).read_bytes(), int(requests), int(concurrency), no_model == "1")
        print(json.dumps(result))
        return
    from benchmarks.service_bench import text_of_length
    from service.bundle import load_bundle
    from service.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--requests", type=int, default=6400, help="per measurement, after a warm-up")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="GIT_REF[,KEY=VALUE...]", nargs="*", default=[])
    parser.add_argument("--no-model", action="store_true", help="the runtime answers zeros: the request path alone")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    load_before = load_average()
    bundle = load_bundle(args.bundle)
    tokenizer = Tokenizer.from_bundle(bundle)
    work = Path(tempfile.mkdtemp(prefix="request-loop-"))
    env = {"LINFORMER_MODELS_DIR": str(bundle.path.resolve().parent), "LINFORMER_CLASSIFY_MODEL": bundle.path.name,
           "LINFORMER_TRANSLATE_MODEL": "", "LINFORMER_LOG_LEVEL": "warning", "LINFORMER_ORT_INTRA_OP_THREADS": "1",
           "LINFORMER_ORT_INTER_OP_THREADS": "1", "LINFORMER_MAX_CONCURRENT_REQUESTS": "256"}  # as service_bench
    variants = [("this service", REPO, env)]
    for index, spec in enumerate(args.baseline):
        ref, *assignments = spec.split(",")
        code_dir = REPO
        if ref != ".":
            code_dir = work / f"baseline-{index}"
            code_dir.mkdir()
            archive = subprocess.run(["git", "archive", ref, "service"], cwd=REPO, capture_output=True,
                                     check=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(code_dir)], input=archive, check=True)
        settings = dict(assignment.split("=", 1) for assignment in assignments)
        name = ("this service" if ref == "." else f"service at {ref}") + "".join(
            f", {key.removeprefix('LINFORMER_')}={value}" for key, value in settings.items())
        variants.append((name, code_dir, {**env, **settings}))
    bodies = {}
    for tokens in args.tokens:
        text, ids = text_of_length(tokenizer, tokens)
        bodies[tokens] = work / f"body-{tokens}.json"
        bodies[tokens].write_text(json.dumps({"text": text}))
    runs: dict[tuple[int, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for tokens in args.tokens:
            for name, code_dir, variant_env in variants:
                result = measure(code_dir, variant_env, bodies[tokens], args.requests, args.concurrency, args.no_model)
                runs.setdefault((tokens, name), []).append(result)
                print(f"round {round_ + 1}, {tokens} tokens, {name}: loop {result['loop_us']:.1f} µs/request, "
                      f"process {result['process_us']:.1f} µs/request, {result['rps']:.0f} req/s, "
                      f"p50 {result['p50_us']:.1f} µs", flush=True)
    rows = [{"tokens": tokens, "service": name,
             "loop_us": round(statistics.median(r["loop_us"] for r in results), 1),
             "loop_us_range": "–".join(f"{f(r['loop_us'] for r in results):.1f}" for f in (min, max)),
             "process_us": round(statistics.median(r["process_us"] for r in results), 1),
             "process_us_range": "–".join(f"{f(r['process_us'] for r in results):.1f}" for f in (min, max)),
             "p50_us": round(statistics.median(r["p50_us"] for r in results), 1),
             "rps": round(statistics.median(r["rps"] for r in results))}
            for (tokens, name), results in runs.items()]  # fmt: skip
    stem = f"request_loop_{bundle.name}" + ("-no-model" if args.no_model else "")
    write_csv(args.out / f"{stem}.csv", rows)
    plot(rows, args.out / f"{stem}.png")
    lines = header(f"The event loop's CPU per /classify request, in-process: {bundle.name}",
                   ("onnxruntime", "sentencepiece", "pydantic", "fastapi", "starlette", "uvloop"), load_before)
    lines += [
        f"Each measurement: a process pinned to core 0 builds the app as `python -m service` does and drives "
        f"{args.requests} requests of one text, {args.concurrency} at a time, straight into its ASGI app (no "
        "sockets, no uvicorn protocol). CPU per request of the event-loop thread and of the whole process "
        f"(inference thread included); medians of {args.rounds} rounds, the variants interleaved in each round. "
        "Log level warning unless a row says otherwise, the access log written to a file."
        + (" **No model**: the runtime answers zeros without `session.run` (`--no-model`): the request path alone."
           if args.no_model else ""),
        "",
        *markdown_table(rows, {"tokens": "tokens", "service": "service", "loop_us": "event loop CPU (µs/request)",
                               "loop_us_range": "its range", "process_us": "process CPU (µs/request)",
                               "process_us_range": "its range", "p50_us": "p50 latency (µs)",
                               "rps": "requests/s"}),  # fmt: skip
        "",
        f"![event loop CPU per request]({stem}.png)",
        "",
    ]
    write_markdown(args.out / f"{stem}.md", lines)


def plot(rows: list[dict], path: Path) -> None:
    import numpy as np

    lengths = sorted({row["tokens"] for row in rows})
    services = list(dict.fromkeys(row["service"] for row in rows))
    fig, axis = agg_subplots(figsize=(7, 3.8))
    width = 0.8 / len(services)
    for i, service in enumerate(services):
        values = [next((r["loop_us"] for r in rows if r["tokens"] == n and r["service"] == service), 0)
                  for n in lengths]  # fmt: skip
        axis.bar(np.arange(len(lengths)) + i * width, values, width, label=service)
    axis.set_xticks(np.arange(len(lengths)) + width * (len(services) - 1) / 2, [f"{n} tokens" for n in lengths])
    axis.set_ylabel("event-loop CPU µs per request")
    axis.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
