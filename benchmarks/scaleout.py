"""Throughput of the compose stack with 1 and 2 replicas of the Linformer deployment behind the balancer,
and what a scale-down under load costs.

    python benchmarks/scaleout.py                          # images built: docker compose build (docker/README.md)
    python benchmarks/scaleout.py --length 2048 --users 4 --duration 30s --rounds 2

Starts `linformer` and `balancer` of compose.yaml (`--no-deps`: the transformer stays down, so the two
replicas have the machine to themselves), then for each round and replica count, alternating 1, 2, 1, 2
so both see the same machine over time: scale, wait until the balancer sees every replica up, warm up,
run the same Locust load (ClassifyUser, one length, closed loop) from this host through the balancer,
and read how many requests each replica served from HAProxy's stats. Last, the drain check: a run at
2 replicas during which one replica is stopped (scale to 1); every failed request is counted.

Writes benchmarks/results/scaleout.{csv,md,png}; the header states the command, machine, load and versions.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

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

RESULTS = REPO / "benchmarks" / "results"
BALANCER = "http://127.0.0.1:8000"
STATS = "http://127.0.0.1:8404/;csv"


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SystemExit("neither `docker compose` nor docker-compose is installed (docker/setup-engine.sh)")


def compose(*args: str) -> None:
    subprocess.run([*COMPOSE, *args], cwd=REPO, check=True)


def backend_servers(backend: str = "linformer") -> list[dict]:
    """HAProxy's stats rows of the backend's servers that have an address (filled template slots)."""
    with urllib.request.urlopen(STATS, timeout=5) as response:
        text = response.read().decode().lstrip("# ")
    rows = list(csv.DictReader(io.StringIO(text)))
    return [r for r in rows if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")
            and r["status"] not in ("MAINT", "MAINT (resolution)")]  # fmt: skip


def scale(replicas: int, timeout_s: float = 300) -> None:
    compose("up", "-d", "--no-deps", "--no-build", "--scale", f"linformer={replicas}", "linformer", "balancer")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            servers = backend_servers()
            if len(servers) == replicas and all(s["status"] == "UP" for s in servers):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the balancer did not see {replicas} replicas up within {timeout_s:.0f} s")
        time.sleep(1)


def served_per_replica() -> dict[str, int]:
    return {s["svname"]: int(s["stot"]) for s in backend_servers()}


def host_cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all cores since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class ReplicaCpu:
    """Samples `docker stats` while a run goes on: the linformer replicas' CPU, summed, in % of one core."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.is_set():
            done = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.CPUPerc}}"],
                                  capture_output=True, text=True)  # fmt: skip
            values = [float(line.split()[1].rstrip("%")) for line in done.stdout.splitlines()
                      if "_linformer_" in line.split()[0]]  # fmt: skip
            if values:
                self.samples.append(sum(values))
            self.stop.wait(3)

    def __enter__(self) -> ReplicaCpu:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join()

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def run_locust(args: argparse.Namespace, duration: str, out: Path) -> dict:
    """One headless Locust run against the balancer; the aggregated row of its stats CSV."""
    env = {**os.environ, "LOADTEST_LENGTHS": str(args.length)}
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/", "ClassifyUser", "--headless", "-u", str(args.users),
         "-r", str(args.users), "-t", duration, "--host", BALANCER, "--csv", str(out), "--only-summary"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    with open(f"{out}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    if "Aggregated" not in rows:
        raise SystemExit(f"locust wrote no stats: {done.stderr[-2000:]}")
    return rows["Aggregated"]


def measure(args: argparse.Namespace, replicas: int, round_: int, tmp: Path) -> dict:
    scale(replicas)
    run_locust(args, args.warmup, tmp / f"warmup-{replicas}-{round_}")
    before, busy_before = served_per_replica(), host_cpu_times()
    with ReplicaCpu() as replica_cpu:
        stats = run_locust(args, args.duration, tmp / f"run-{replicas}-{round_}")
    after, busy_after = served_per_replica(), host_cpu_times()
    host_busy = (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
    shares = sorted((after[name] - before.get(name, 0) for name in after), reverse=True)
    return {
        "round": round_,
        "replicas": replicas,
        "requests": int(stats["Request Count"]),
        "failures": int(stats["Failure Count"]),
        "requests_per_s": float(stats["Requests/s"]),
        "p50_ms": float(stats["50%"]),
        "p95_ms": float(stats["95%"]),
        "served_per_replica": " / ".join(map(str, shares)),
        "replicas_cpu_pct": replica_cpu.mean(),
        "host_busy_pct": 100 * host_busy,
        "load_average": load_average().split(" (")[0],
    }


def drain_check(args: argparse.Namespace, tmp: Path) -> dict:
    """2 replicas under load; a third of the way in, scale to 1 (compose stops one: SIGTERM, drain)."""
    scale(2)
    run_locust(args, args.warmup, tmp / "warmup-drain")
    seconds = int(args.duration.rstrip("s"))

    def scale_down() -> None:
        time.sleep(seconds / 3)
        compose("up", "-d", "--no-deps", "--no-build", "--scale", "linformer=1", "linformer")

    stopper = threading.Thread(target=scale_down)
    stopper.start()
    stats = run_locust(args, args.duration, tmp / "drain")
    stopper.join()
    return {
        "round": "drain",
        "replicas": "2 -> 1",
        "requests": int(stats["Request Count"]),
        "failures": int(stats["Failure Count"]),
        "requests_per_s": float(stats["Requests/s"]),
        "p50_ms": float(stats["50%"]),
        "p95_ms": float(stats["95%"]),
        "served_per_replica": "",
        "load_average": load_average().split(" (")[0],
    }


def write_report(args: argparse.Namespace, rows: list[dict], drain: dict, load_before: str, info: str) -> Path:
    stem = args.out / "scaleout"
    write_csv(stem.with_suffix(".csv"), [*rows, drain])
    by_replicas = {r: [row["requests_per_s"] for row in rows if row["replicas"] == r] for r in (1, 2)}
    mean = {r: sum(v) / len(v) for r, v in by_replicas.items()}
    lines = header("Scale-out: 1 vs 2 replicas behind the balancer", ("locust",), load_before)
    lines += [
        f"- stack: {info}",
        f"- load: Locust ClassifyUser from this host through the balancer (:8000), {args.users} users, closed "
        f"loop, texts of n = {args.length} tokens, {args.duration} per run after {args.warmup} of warm-up; "
        "rounds alternate 1 and 2 replicas",
        "",
        *markdown_table(rows, {"round": "round", "replicas": "replicas", "requests": "requests",
                               "failures": "failures", "requests_per_s": "requests/s", "p50_ms": "p50 ms",
                               "p95_ms": "p95 ms", "served_per_replica": "served by each replica",
                               "replicas_cpu_pct": "replicas' CPU, % of one core (docker stats)",
                               "host_busy_pct": f"host CPU busy, % of {os.cpu_count()} cores",
                               "load_average": "load (1/5/15 min) after"}),  # fmt: skip
        "",
        f"**2 replicas / 1 replica: {mean[2] / mean[1]:.2f}× the requests/s** (mean of the rounds: "
        f"{mean[1]:.1f} against {mean[2]:.1f}; each replica is limited to 1 CPU, the host has {os.cpu_count()}).",
        "",
        "## Drain: one of 2 replicas stopped under load",
        "",
        *markdown_table([drain], {"replicas": "replicas", "requests": "requests", "failures": "failures",
                                  "requests_per_s": "requests/s", "p50_ms": "p50 ms", "p95_ms": "p95 ms"}),
        "",
        f"**{drain['failures']} failed requests of {drain['requests']}** while compose stopped a replica "
        "(SIGTERM: it stops accepting and drains; the balancer retries refused connections elsewhere).",
        "",
        "![requests/s per round](scaleout.png)",
        "",
    ]  # fmt: skip
    write_markdown(stem.with_suffix(".md"), lines, echo=False)
    plot(rows, stem.with_suffix(".png"))
    return stem


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = agg_subplots(figsize=(6, 3.5))
    for replicas, color in ((1, "tab:blue"), (2, "tab:orange")):
        points = [(row["round"], row["requests_per_s"]) for row in rows if row["replicas"] == replicas]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=color, label=f"{replicas} replica(s)")
    ax.set_xlabel("round")
    ax.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("Linformer deployment behind HAProxy")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="classify text length (tokens)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--duration", default="30s", help="per run, in seconds (e.g. 30s)")
    parser.add_argument("--warmup", default="5s")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load_before = load_average()
    engine = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    driver = subprocess.run(["docker", "info", "--format", "{{.Driver}}"], capture_output=True, text=True).stdout
    compose_version = subprocess.run([*COMPOSE, "version", "--short"], capture_output=True, text=True).stdout
    info = (f"Docker engine {engine} ({driver.strip()} storage), {' '.join(COMPOSE)} {compose_version.strip()}, "
            f"compose.yaml: cpus 1.0 per replica, 1 ORT thread, HAProxy leastconn")  # fmt: skip
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(1, args.rounds + 1):
                for replicas in (1, 2):
                    rows.append(measure(args, replicas, round_, Path(tmp)))
                    print(rows[-1], flush=True)
            drain = drain_check(args, Path(tmp))
            print(drain, flush=True)
    finally:
        if not args.keep:
            compose("down", "--timeout", "40")
    stem = write_report(args, rows, drain, load_before, info)
    print(f"wrote {stem}.{{csv,md,png}}")


COMPOSE = compose_command() if __name__ == "__main__" else []

if __name__ == "__main__":
    main()
