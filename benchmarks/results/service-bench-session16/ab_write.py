"""Two servers pinned to core 0 taking turns under wrk (core 1), 64 connections, 8 rounds of 2 s warm-up + 4 s:
this checkout's service against service/ at a git ref (default HEAD). Run with the experiment applied:
    git apply benchmarks/results/service-bench-session16/experiments.patch
    LINFORMER_EXP_ONE_WRITE=1 ORT_DISABLE_TELEMETRY=1 python benchmarks/results/service-bench-session16/ab_write.py 16
(the patch's switch is read by the server: export it so that `this service` inherits it; the ref's service has none)."""
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks import service_bench as sb  # noqa: E402
from benchmarks.loadgen import service_at  # noqa: E402
from service.bundle import load_bundle  # noqa: E402
from service.tokenizer import Tokenizer  # noqa: E402

bundle = load_bundle(REPO / "models" / "classify-linformer")
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16
ref = sys.argv[2] if len(sys.argv) > 2 else "HEAD"
connections, rounds = 64, 8
text, _ = sb.text_of_length(Tokenizer.from_bundle(bundle), tokens)
work = REPO / ".cache" / "ab-write"
servers = sb.make_servers(bundle, text, [], "", [(ref, service_at(ref, work), {})])
loop_ms: dict[str, list[float]] = {s.name: [] for s in servers}
rps: dict[str, list[float]] = {s.name: [] for s in servers}
try:
    for i, server in enumerate(servers):
        server.start(work / f"log{i}.txt")
    for r in range(rounds):
        for server in servers if r % 2 == 0 else servers[::-1]:
            sb.wrk(server, connections, 2)
            cpu0, loop0 = server.cpu_seconds(), server.main_thread_cpu_seconds()
            result = sb.wrk(server, connections, 4)
            cpu1, loop1 = server.cpu_seconds(), server.main_thread_cpu_seconds()
            rps[server.name].append(result["rps"])
            loop_ms[server.name].append((loop1 - loop0) / result["requests"] * 1000)
            cpu_ms = (cpu1 - cpu0) / result["requests"] * 1000
            print(r, server.name, round(result["rps"]), "req/s", round(cpu_ms, 3), "ms CPU/req",
                  round(loop_ms[server.name][-1], 3), "ms loop/req", flush=True)  # fmt: skip
finally:
    for server in servers:
        server.stop()
for name in rps:
    print(name, "median req/s", round(statistics.median(rps[name])),
          "median loop ms/req", round(statistics.median(loop_ms[name]), 4))  # fmt: skip
