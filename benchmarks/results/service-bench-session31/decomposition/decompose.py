"""Where a /classify request's cost goes, by taking the service apart (thirty-first session, issue #20):

    python benchmarks/results/service-bench-session31/decomposition/decompose.py [--tokens 64] [--connections 1 64]
                                                                                  [--turns 3] [--seconds 5]

Four servers of the same bundle on core 0, wrk on core 1, measured as `benchmarks/service_bench.py` measures (its
`Server`, `take_turns`, `model_alone`), taking turns at each concurrency (the order reversed every other turn; each
figure the median of the turns):
1. the floor (`benchmarks/peers/floor_classify.py`): no per-request work but `session.run`;
2. a bare asyncio protocol with the service's request steps (`steps_servers.py bare`);
3. uvicorn with a minimal ASGI app and the same steps (`steps_servers.py uvicorn`);
4. the service (`python -m service`).
2 - 1 is what the request steps cost (validation, tokenising, the batcher and its compute thread, the answer), 3 - 2
uvicorn's protocol and ASGI, 4 - 3 the service's own middleware and protocol subclass (request ids, admission,
deadlines, disconnect watch, metrics, error answers). Writes decompose-<tokens>.md beside this file."""

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO))

from benchmarks.service_bench import (  # noqa: E402
    FLOOR,
    Server,
    best_of,
    machine,
    make_servers,
    median_row,
    model_alone,
    take_turns,
    text_of_length,
)
from service.bundle import load_bundle  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=REPO / "models" / "classify-linformer")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    bundle = load_bundle(args.bundle)
    text, ids = text_of_length(Tokenizer.from_bundle(bundle), args.tokens)
    model = model_alone(bundle, ids, seconds=2.0)
    floor_batch = model["best_batch"]  # this first measurement's (the table gives the best of two)
    service, floor = make_servers(bundle, text, [], "", [], floor_batch=floor_batch)
    steps = [Server(name, [sys.executable, str(HERE / "steps_servers.py"), front, "--port", "{port}"], service.env,
                    "/classify", service.body, "/", service.batch_metrics)  # fmt: skip
             for name, front in (("bare protocol + the request steps", "bare"),
                                 ("uvicorn + the request steps", "uvicorn"))]  # fmt: skip
    servers = [floor, *steps, service]
    logs = Path(tempfile.mkdtemp(prefix="decompose-"))
    rows = []
    try:
        for server in servers:
            server.start(logs / f"{server.name.split()[0]}.log")
        for connections in args.connections:

            def show(server: Server, row: dict, connections: int = connections) -> None:
                print(f"{server.name:>36} c={connections:<3} {row['rps']:6.0f} req/s p50 {row['p50_ms']:.3f} "
                      f"CPU/req {row['cpu_ms_per_request']:.3f} batch {row['mean_batch']:.1f}", flush=True)

            turns = take_turns(servers, connections, args.turns, args.seconds, model, show)
            rows += [median_row(turns[server.name]) for server in servers]
    finally:
        for server in servers:
            server.stop()
    model = best_of(model, model_alone(bundle, ids, seconds=2.0))
    info = machine()
    lines = [
        f"# Where a {len(ids)}-token /classify request's cost goes ({bundle.name})",
        "",
        f"- command: `python {Path(__file__).relative_to(REPO)} {' '.join(sys.argv[1:])}`",
        f"- machine: {info['nproc']} cores, {info['cpu']}; python {info['python']}, onnxruntime "
        f"{info['onnxruntime']}, uvicorn {info['uvicorn']}; git commit {info['git_commit']}",
        f"- model alone: batch-1 p50 {model['batch1_p50_ms']:.3f} ms; best batch {model['best_batch']}, "
        f"{model['best_rate']:.0f} texts/s, {model['cpu_ms'][model['best_batch']]:.3f} ms CPU per text (best of the "
        f"measurements before and after; the floor's batches: at most {floor_batch}, the first one's best size)",
        f"- {args.turns} turns of {args.seconds:g} s per server and concurrency, taking turns; medians",
        "",
        "| server | connections | req/s | / model alone | p50 (ms) | p50 over batch-1 (ms) | CPU/request (ms) | "
        "over the floor's (ms) | mean batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        floor_row = next(r for r in rows if r["server"] == FLOOR and r["connections"] == row["connections"])
        lines.append(f"| {row['server']} | {row['connections']} | {row['rps']:.0f} | "
                     f"{row['rps'] / model['best_rate']:.2f} | {row['p50_ms']:.3f} | "
                     f"{row['p50_ms'] - model['batch1_p50_ms']:.3f} | {row['cpu_ms_per_request']:.3f} | "
                     f"{row['cpu_ms_per_request'] - floor_row['cpu_ms_per_request']:+.3f} | "
                     f"{row['mean_batch']:.1f} |")  # fmt: skip
    spread = {s.name: [t["rps"] for t in turns[s.name]] for s in servers}
    lines += ["", "req/s of each turn at the last concurrency: "
              + "; ".join(f"{name}: {', '.join(f'{v:.0f}' for v in values)}" for name, values in spread.items()), ""]
    out = HERE / f"decompose-{len(ids)}.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
