"""End-to-end sweep: Linformer (and optionally Performer) vs Transformer deployments under Locust, runs
per (n, users, deployment).

    python -m loadtest.sweep                                  # compose deployments on :8000 and :8001
    python -m loadtest.sweep --spawn                          # start both as local processes instead
    python -m loadtest.sweep --spawn --users 1,4 --duration 30s --lengths 512,1024,2048,4096
    python -m loadtest.sweep --spawn --labels linformer,performer,transformer   # a third deployment

For each length n (and each user count), every deployment gets one headless Locust run of ClassifyUser
(or TranslateUser) with a fixed number of closed-loop users for a fixed time, sending texts of exactly
n tokens. Deployments alternate their order from one length to the next, and each run is preceded
by a few sequential warm-up requests. With one user (classify), one PairedClassifyUser run sends each
text to both deployments in turn instead (--no-paired: one run each): the machine's speed drifts by
several percent from one second to the next, and a paired run exposes both to the same drift.
Then loadtest/results/sweep-<task>.{csv,md,png}: p50, p95, p99 and requests/s per n and deployment,
and each deployment's speedup over the last one named (the Transformer) per n.

--spawn starts two `python -m service` processes with identical LINFORMER_* settings that differ
only in the bundle (LINFORMER_CLASSIFY_MODEL=classify-linformer / classify-transformer), both pinned
with taskset to the same core(s) and given the same ORT thread counts; only one is under load at a
time. The load generator is pinned to the other core(s).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):  # `python loadtest/sweep.py`, or imported by `locust -f loadtest/`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.report import (  # noqa: E402
    agg_subplots,
    header,
    load_average,
    markdown_table,
    save_figure,
    write_csv,
    write_markdown,
)
from loadtest.texts import (  # noqa: E402
    CLASSIFY_LENGTHS,
    TRANSLATE_LENGTHS,
    prepare,
    texts_of_length,
    translate_max_new_tokens,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
USER_CLASS = {"classify": "ClassifyUser", "translate": "TranslateUser"}
LENGTHS_ENV = {"classify": "LOADTEST_LENGTHS", "translate": "LOADTEST_TRANSLATE_LENGTHS"}


# ---- deployments ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(base: str, proc: subprocess.Popen | None = None, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{base}: server exited with {proc.returncode}")
        try:
            if get_json(f"{base}/readyz", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{base} did not become ready in {timeout_s:g} s")


def serving_settings(args: argparse.Namespace) -> dict[str, str]:
    """LINFORMER_* settings shared by both spawned deployments (the bundle names are added per label)."""
    return {
        "LINFORMER_MODELS_DIR": str(args.models_dir),
        "LINFORMER_ORT_INTRA_OP_THREADS": str(args.threads),
        "LINFORMER_ORT_INTER_OP_THREADS": "1",
        "LINFORMER_EXECUTION_PROVIDER": "cpu",
        "LINFORMER_LOG_LEVEL": "warning",
        **{key: value for key, value in os.environ.items() if key.startswith("LINFORMER_MAX_")},
    }


def spawn(label: str, args: argparse.Namespace, stack: ExitStack, log_dir: Path) -> str:
    """Start `python -m service` for one deployment, pinned with taskset; returns its base URL."""
    port = free_port()
    # only the swept task's bundle: a configured bundle that is missing keeps /readyz at 503 (service.app), and
    # the Performer and the tests' model folders have no translate bundle; an empty name leaves the task unconfigured
    bundles = {f"LINFORMER_{task.upper()}_MODEL": f"{task}-{label}" if task == args.task else ""
               for task in USER_CLASS}  # fmt: skip
    env = {**os.environ, **serving_settings(args), **bundles}
    log = stack.enter_context(open(log_dir / f"server-{label}.log", "w"))
    command = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
    if args.server_cpus:
        command = ["taskset", "-c", args.server_cpus, *command]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()

    stack.callback(stop)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return base


def describe(base: str, task: str) -> str:
    """The deployment's model for `task` as GET /v1/models reports it: name, attention, n_max, k."""
    status, body = get_json(f"{base}/v1/models")
    models = [m for m in body.get("models", []) if m.get("task") == task] if status == 200 else []
    if not models:
        return f"no {task} model"
    m = models[0]
    return f"{m['name']} ({m['attention']}, n_max {m['n_max']}, k {m['k']}, {m['execution_provider']})"


# ---- one run ----


def warm_up(base: str, task: str, n: int, requests: int) -> tuple[list[int], list[int]]:
    """Sequential requests before measuring (first-run allocations): the input tokens the service saw
    (classify) and the output tokens it generated (translate: decoding time follows them)."""
    seen, generated = [], []
    for text in (texts_of_length(task, n) * requests)[:requests]:
        if task == "classify":
            reply = post_json(f"{base}/classify", {"texts": [text], "truncate": True})
            seen.append(reply["results"][0]["tokens"])
        else:
            body = {"texts": [text], "truncate": True, "max_new_tokens": translate_max_new_tokens(n),
                    "split_sentences": False}  # fmt: skip
            reply = post_json(f"{base}/translate", body)
            seen.append(n)  # the reply counts output tokens only
            generated.append(reply["translations"][0]["tokens"])
    return seen, generated


def run_locust(args: argparse.Namespace, n: int, users: int, prefix: Path, hosts: dict[str, str]) -> dict[str, dict]:
    """One headless Locust run at one length: against one deployment, or, given two, one PairedClassifyUser
    sending each text to both. Returns each deployment's row of Locust's stats CSV, with its exact times."""
    paired = len(hosts) > 1
    user_class = "PairedClassifyUser" if paired else USER_CLASS[args.task]
    names = {label: f"/{args.task} n={n}" + (f" {label}" if paired else "") for label in hosts}
    command = ["locust", "-f", str(Path(__file__).parent / f"{args.task}.py"), user_class,
               "--headless", "-u", str(users), "-r", str(users), "-t", args.duration,
               "--host", next(iter(hosts.values())), "--csv", str(prefix), "--only-summary",
               "--loglevel", "WARNING", "--exit-code-on-error", "0", "--stop-timeout", "60"]  # fmt: skip
    locust = Path(sys.executable).with_name("locust")
    command[0] = str(locust) if locust.exists() else "locust"
    if args.client_cpus:
        command = ["taskset", "-c", args.client_cpus, *command]
    times = Path(f"{prefix}_times.csv")  # every request's exact time (see loadtest.texts.record_response_times)
    times.unlink(missing_ok=True)
    env = {**os.environ, LENGTHS_ENV[args.task]: str(n), "LINFORMER_MODELS_DIR": str(args.models_dir),
           "LOADTEST_RESPONSE_TIMES": str(times)}  # fmt: skip
    if paired:
        env["LOADTEST_PAIRED_HOSTS"] = ",".join(f"{label}={base}" for label, base in hosts.items())
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"locust failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(f"{prefix}_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    exact: dict[str, list[float]] = {name: [] for name in names.values()}
    for line in times.read_text().splitlines() if times.exists() else []:
        name, ms = line.rsplit(",", 1)
        if name in exact:
            exact[name].append(float(ms))
    rows = {}
    for label, name in names.items():
        if name not in stats:
            raise RuntimeError(f"no '{name}' row in {prefix}_stats.csv:\n{done.stderr[-2000:]}")
        rows[label] = {**stats[name], "exact": exact[name]}
    return rows


def merge_runs(runs: list[dict]) -> dict:
    """One deployment's rounds at one (n, users) as one run: counts add up, requests/s is the mean of the
    rounds', exact times pool (Locust's rounded percentiles are the first round's, used only without them)."""
    if len(runs) == 1:
        return runs[0]
    total = sum(int(r["Request Count"]) for r in runs)
    mean = sum(float(r["Average Response Time"]) * int(r["Request Count"]) for r in runs) / max(total, 1)
    return {
        **runs[0],
        "Request Count": total,
        "Failure Count": sum(int(r["Failure Count"]) for r in runs),
        "Requests/s": statistics.mean(float(r["Requests/s"]) for r in runs),
        "Average Response Time": mean,
        "exact": [ms for r in runs for ms in r.get("exact") or []],
    }


def to_row(label: str, n: int, users: int, stats: dict) -> dict:
    def number(key: str) -> float | None:
        value = stats.get(key, "")
        return float(value) if value not in ("", "N/A") else None

    row = {
        "deployment": label, "n": n, "users": users,
        "requests": int(stats["Request Count"]), "failures": int(stats["Failure Count"]),
        "requests_per_s": round(number("Requests/s") or 0.0, 3),
        "p50_ms": number("50%"), "p95_ms": number("95%"), "p99_ms": number("99%"),
        "mean_ms": round(number("Average Response Time") or 0.0, 1),
        "percentiles": "locust (rounded)",
        "load_average_1min": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    exact = stats.get("exact") or []
    if exact:  # the same requests, unrounded (failures excluded)
        cuts = statistics.quantiles(exact, n=100, method="inclusive") if len(exact) > 1 else exact * 99
        p50, p95, p99 = cuts[49], cuts[94], cuts[98]
        row |= {"p50_ms": round(p50, 2), "p95_ms": round(p95, 2), "p99_ms": round(p99, 2),
                "mean_ms": round(statistics.mean(exact), 2), "percentiles": f"exact ({len(exact)} requests)"}
    return row


# ---- report ----


MODEL_LEVEL = "table3-served-mean"  # the served classify-linformer: k = 128, mean pooling


def time_bundles(args: argparse.Namespace, n: int) -> dict[str, float]:
    """label -> the served classify bundle's median session.run at batch 1 and length n, in ms, timed in
    rotating rounds in a process pinned and threaded like the spawned servers, just before a round of load.

    Table 3 ran minutes or hours earlier, on random-initialised copies and 9 rounds; this machine's speed
    drifts by tens of percent over minutes, so the e2e/model share compares with this measurement."""
    bundles = {label: args.models_dir / f"classify-{label}" for label in args.labels}
    paths = {label: str(bundle / "model.onnx") for label, bundle in bundles.items()}
    vocab = min(json.loads((b / "config.json").read_text())["model_config"]["vocab_size"] for b in bundles.values())
    command = [sys.executable, "-m", "loadtest.table3", "time", str(n), str(args.threads),
               str(args.model_seconds), str(vocab), *paths.values()]  # fmt: skip
    if args.server_cpus:
        command = ["taskset", "-c", args.server_cpus, *command]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    return {label: timed[path]["ms"] for label, path in paths.items()}


def model_level_speedups(label: str = "linformer") -> dict[int, float]:
    """n -> Table 3 speedup over vanilla (served size, k = 128 with the served projection, or the Performer)
    when loadtest.table3 has written it."""
    path = RESULTS / f"{MODEL_LEVEL}.csv"
    column = {"linformer": "speedup", "performer": "performer_speedup"}.get(label)
    if column is None or not path.exists():
        return {}
    with open(path, newline="") as f:
        return {int(r["n"]): float(r[column]) for r in csv.DictReader(f) if r["k"] == "128" and r.get(column)}


def comparison_rows(
    rows: list[dict], labels: tuple[str, str], model_level: dict[int, float] | None = None
) -> list[dict]:
    """One row per (users, n): both deployments' numbers side by side, and the speedups.

    speedup = Transformer p50 / Linformer p50 (latency), throughput = Linformer req/s / Transformer req/s.
    """
    fast, slow = labels
    model_level = model_level or {}
    table = []
    for users in sorted({r["users"] for r in rows}):
        for n in sorted({r["n"] for r in rows if r["users"] == users}):
            pair = {r["deployment"]: r for r in rows if r["users"] == users and r["n"] == n}
            if fast not in pair or slow not in pair:
                continue
            a, b = pair[fast], pair[slow]
            row = {"users": users, "n": n}
            for label, r in ((fast, a), (slow, b)):
                for key in ("p50_ms", "p95_ms", "p99_ms", "mean_ms", "requests_per_s", "failures"):
                    row[f"{label}_{key}"] = r[key]
                if "warmup_output_tokens" in r:
                    row[f"{label}_output_tokens"] = r["warmup_output_tokens"]
            row["speedup_p50"] = round(b["p50_ms"] / a["p50_ms"], 2) if a["p50_ms"] and b["p50_ms"] else None
            row["speedup_p95"] = round(b["p95_ms"] / a["p95_ms"], 2) if a["p95_ms"] and b["p95_ms"] else None
            # Locust keeps whole milliseconds below 100 ms: at 4 vs 5 ms the mean is the finer ratio
            row["speedup_mean"] = round(b["mean_ms"] / a["mean_ms"], 2) if a["mean_ms"] and b["mean_ms"] else None
            if a.get("p50_by_round_ms") and b.get("p50_by_round_ms"):  # how far single rounds scatter
                by_round = zip(a["p50_by_round_ms"].split(), b["p50_by_round_ms"].split(), strict=True)
                row["speedup_by_round"] = " / ".join(f"{float(y) / float(x):.2f}" for x, y in by_round)
            rps = a["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else None
            row["throughput_ratio"] = None if rps is None else round(rps, 2)
            row["table3_speedup"] = model_level.get(n)
            if a.get("model_ms") and b.get("model_ms"):  # timed by this sweep around the load
                reference = b["model_ms"] / a["model_ms"]
            else:
                reference = model_level.get(n)
            row["model_level_speedup"] = None if reference is None else round(reference, 2)
            # from the unrounded ratios: 1.323 / 1.455 is 0.909, while 1.32 / 1.46 would print 0.90
            share = b["p50_ms"] / a["p50_ms"] / reference if reference and a["p50_ms"] and b["p50_ms"] else None
            row["e2e_over_model"] = None if share is None else round(share, 3)
            table.append(row)
    return table


def write_report(args: argparse.Namespace, rows: list[dict], info: dict, load_before: str) -> Path:
    labels = tuple(args.labels)
    stem = args.out / f"sweep-{args.task}{args.suffix}"
    write_csv(stem.with_suffix(".csv"), rows)
    *challengers, slow = labels  # each against the last: the Transformer
    fast = " / ".join(challengers)
    tables = {
        label: comparison_rows(rows, (label, slow), model_level_speedups(label) if args.task == "classify" else None)
        for label in challengers
    }
    lines = header(f"End-to-end sweep: {args.task}, {fast} vs {slow} deployments under Locust",
                   ("locust", "onnxruntime", "fastapi", "uvicorn"), load_before)  # fmt: skip
    if args.spawn:
        how = (
            f"Deployments: spawned by this sweep as {len(labels)} `python -m service` processes with identical "
            f"settings {json.dumps(serving_settings(args))} (batching limits at the service defaults unless set), "
            f"differing only in LINFORMER_{args.task.upper()}_MODEL (the other task left unconfigured); all pinned "
            f"with `taskset -c {args.server_cpus or 'all'}` and {args.threads} ORT intra-op thread(s); only the "
            f"deployment under test receives load. Locust pinned with `taskset -c {args.client_cpus or 'all'}`."
        )
    else:
        how = (
            "Deployments: already running (e.g. docker/compose.yaml: equal `cpus`, memory and LINFORMER_* "
            "settings, differing only in the bundles); this sweep only sends load."
        )
    lines += [
        how,
        "",
        "Deployments as they describe themselves (GET /v1/models): "
        + "; ".join(f"{label} at {v['base']}: {v['model']}" for label, v in info.items()),
        "",
        f"Load: {args.rounds} headless Locust run(s) per (n, users), pooled, closed loop (each user keeps one "
        f"request in flight, no think time), {args.duration} per run after {args.warmup} sequential warm-up "
        "requests to each deployment"
        + (", each round after timing both bundles. " if args.task == "classify" and args.spawn else ". ")
        + (
            "With 1 user a run is one PairedClassifyUser over all deployments: each text goes to each, one "
            "right after the other, in alternating order, so all answer under the same machine state request "
            "by request (`runs` = paired in the CSV; its req/s is 1000 / mean latency, what that user would get "
            f"from one deployment alone). With more users each deployment gets its own {USER_CLASS[args.task]} "
            "run, and they take turns, in alternating order, round by round. "
            if args.paired and args.task == "classify"
            else f"Each deployment gets its own {USER_CLASS[args.task]} run, and they take turns, in "
            "alternating order, round by round. "
        )
        + "Each request is one "
        + (
            "held-out IMDB test review text of exactly n tokens; the service's reported token count is checked "
            "on every reply. "
            if args.task == "classify"
            else "held-out EN-DE test source text of exactly n tokens (EOS included), greedy decoding. "
        )
        + "Percentiles are computed from every successful request's exact response time as Locust measured it "
        "(its own CSV, in the raw folder, rounds to whole ms below 100 ms and 2 significant digits above; a row "
        "whose `percentiles` column in the CSV says `locust (rounded)` had no exact times). "
        f"speedup = {slow} latency / {fast} latency (speedup mean: of the mean latencies; by round: each "
        "round's own p50 ratio, to show how far one round scatters); "
        f"throughput = {fast} req/s / {slow} req/s"
        + (
            f"; Table 3 = loadtest/results/{MODEL_LEVEL}.md (k = 128 as served, the Performer's M as served, batch 1, "
            "random-initialised copies); model-level (now) = the served bundles' median `session.run` at batch 1 "
            "and length n, timed "
            "in rotating rounds by this sweep before each round of runs and after the last, pinned and threaded "
            f"like the servers ({args.model_seconds:g} s each time, averaged over the {args.rounds + 1} timings; "
            "Table 3's figure where the sweep did not time them); "
            "e2e/model = speedup p50 / model-level (now). The machine's speed drifts over minutes, so the share "
            "is taken against a measurement made at the same time."
            if args.task == "classify"
            else "."
        ),
        "",
    ]
    for challenger, table in tables.items():
        columns = {"n": "n"}
        for label in (challenger, slow):
            columns |= {f"{label}_p50_ms": f"{label} p50 ms", f"{label}_p95_ms": f"{label} p95 ms",
                        f"{label}_p99_ms": f"{label} p99 ms", f"{label}_requests_per_s": f"{label} req/s"}  # fmt: skip
            if args.task == "translate":  # decoding time follows the output length: show it
                columns[f"{label}_output_tokens"] = f"{label} output tokens (warm-up mean)"
        columns |= {"speedup_p50": "speedup p50", "speedup_by_round": "speedup p50 by round",
                    "speedup_p95": "speedup p95", "speedup_mean": "speedup mean",
                    "throughput_ratio": "throughput ratio"}  # fmt: skip
        if args.task == "classify":  # Table 3 is the classifier's
            columns |= {"table3_speedup": "Table 3 speedup", "model_level_speedup": "model-level speedup (now)",
                        "e2e_over_model": "e2e / model"}  # fmt: skip
        versus = f" — {challenger} vs {slow}" if len(tables) > 1 else ""
        for users in sorted({r["users"] for r in table}):
            lines += [f"## {users} user{'s' if users > 1 else ''}{versus}", ""]
            lines += markdown_table([r for r in table if r["users"] == users], columns) + [""]
    failures = sum(r["failures"] for r in rows)
    if args.task == "translate":
        lines += [
            "Translate: decoding dominates and stops at EOS, and the two models generate different lengths for "
            "the same source (output tokens column, from the warm-up replies; greedy, max_new_tokens = 2n + 8). "
            "These latency ratios compare output lengths as much as attention; the encoder's share is small at "
            "these n (the bundles' n_max is 256).",
            "",
        ]
    lines += [
        f"Failures across all runs: {failures} (a reply with the wrong token count or a non-200 status counts).",
        "",
        "Caveats: a 2-core machine, possibly shared with other jobs (load average in the header and in "
        "sweep CSV rows), and the load generator shares it too; p99 from a short run rests on few requests at "
        "large n. Treat single-digit-percent differences as noise.",
        "",
        f"![latency and throughput vs n]({stem.name}.png)",
        "",
    ]
    write_markdown(stem.with_suffix(".md"), lines, echo=False)
    plot(rows, labels, stem.with_suffix(".png"), args.task)
    return stem


def plot(rows: list[dict], labels: tuple[str, ...], path: Path, task: str) -> None:
    fig, (left, right) = agg_subplots(1, 2, figsize=(11, 4.2))
    markers = "osD^v<>"  # one per user count; one colour per deployment; p50 solid, p95 dotted
    for u, users in enumerate(sorted({r["users"] for r in rows})):
        for colour, label in enumerate(labels):
            sub = sorted((r for r in rows if r["deployment"] == label and r["users"] == users), key=lambda r: r["n"])
            if not sub:
                continue
            ns, style = [r["n"] for r in sub], {"color": f"C{colour}", "marker": markers[u % len(markers)]}
            left.plot(ns, [r["p50_ms"] for r in sub], "-", label=f"{label} p50, {users} user(s)", **style)
            left.plot(ns, [r["p95_ms"] for r in sub], ":", label=f"{label} p95, {users} user(s)", **style)
            right.plot(ns, [r["requests_per_s"] for r in sub], "-", label=f"{label}, {users} user(s)", **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per text n")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    left.set_ylabel("latency (ms)")
    left.set_title(f"/{task} latency")
    right.set_ylabel("requests / s")
    right.set_title(f"/{task} throughput")
    save_figure(fig, path, dpi=120)


# ---- main ----


def parse_hosts(raw: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in raw.split(","))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=tuple(USER_CLASS), default="classify")
    parser.add_argument("--hosts", default="linformer=http://127.0.0.1:8000,transformer=http://127.0.0.1:8001",
                        help="label=url,label=url (ignored with --spawn)")  # fmt: skip
    parser.add_argument("--labels", default="linformer,transformer", type=lambda s: s.split(","),
                        help="the deployments (bundles classify-<label>), the baseline last; "
                             "linformer,performer,transformer adds the Performer")  # fmt: skip
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--users", default="1,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--duration", default="30s", help="Locust --run-time of each run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs per (n, users, deployment), alternating deployments; their results pool")
    parser.add_argument("--warmup", type=int, default=3, help="sequential requests before each run")
    parser.add_argument("--paired", action=argparse.BooleanOptionalAction, default=True,
                        help="classify, 1 user: one PairedClassifyUser run over both deployments per round "
                             "(same texts, alternating request by request) instead of one run each")
    parser.add_argument("--spawn", action="store_true", help="start both deployments as local processes")
    parser.add_argument("--models-dir", type=Path, default=REPO / "models")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads of spawned servers")
    parser.add_argument("--server-cpus", help="taskset core list for spawned servers (default: 1 with --spawn)")
    parser.add_argument("--client-cpus", help="taskset core list for locust (default: 0 with --spawn)")
    parser.add_argument("--model-seconds", type=float, default=10,
                        help="classify with --spawn: seconds timing both bundles' session.run alone, per round")
    parser.add_argument("--suffix", default="", help="appended to the results' file names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default loadtest/results)")
    args = parser.parse_args(argv)
    args.models_dir = args.models_dir.resolve()
    if args.spawn and os.cpu_count() and os.cpu_count() > 1:
        args.server_cpus = args.server_cpus or "1"
        args.client_cpus = args.client_cpus or "0"
    lengths = args.lengths or list(CLASSIFY_LENGTHS if args.task == "classify" else TRANSLATE_LENGTHS)
    os.environ["LINFORMER_MODELS_DIR"] = str(args.models_dir)  # the texts use the bundles' tokenizer
    prepare(args.task, lengths)  # the locust processes read these instead of tokenising again

    load_before = load_average()
    raw = args.out / f"sweep-{args.task}{args.suffix}"
    raw.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with ExitStack() as stack:
        if args.spawn:
            hosts = {label: spawn(label, args, stack, raw) for label in args.labels}
        else:
            hosts = parse_hosts(args.hosts)
            missing = [label for label in args.labels if label not in hosts]
            if missing:
                parser.error(f"--hosts has no URL for {', '.join(missing)} (e.g. --hosts ...,{missing[0]}=URL)")
            hosts = {label: hosts[label] for label in args.labels}
            for base in hosts.values():
                wait_ready(base, timeout_s=30)
        info = {label: {"base": base, "model": describe(base, args.task)} for label, base in hosts.items()}
        for i, n in enumerate(lengths):
            for users in args.users:
                runs: dict[str, list[dict]] = {label: [] for label in args.labels}
                timings: list[dict[str, float]] = []  # label -> ms, before each round and after the last
                generated: dict[str, list[int]] = {label: [] for label in args.labels}
                paired = args.paired and users == 1 and args.task == "classify"
                timed = args.task == "classify" and args.spawn
                for r in range(args.rounds):  # short alternating rounds: the machine's drift hits both alike
                    order = args.labels if (i + r) % 2 == 0 else args.labels[::-1]
                    if timed:
                        timings.append(time_bundles(args, n))
                    for group in [order] if paired else [[label] for label in order]:
                        for label in group:
                            seen, output_tokens = warm_up(hosts[label], args.task, n, args.warmup)
                            if any(tokens != n for tokens in seen):
                                raise RuntimeError(f"{label} saw {seen} tokens for texts of {n}: tokenizer mismatch?")
                            generated[label] += output_tokens
                        prefix = raw / f"locust_{'paired' if paired else group[0]}_n{n}_u{users}_r{r}"
                        group_hosts = {label: hosts[label] for label in group}
                        for label, run in run_locust(args, n, users, prefix, group_hosts).items():
                            runs[label].append(run)
                if timed:  # and once after the last round, so the timings bracket every run
                    timings.append(time_bundles(args, n))
                for label in args.labels:
                    rows.append(to_row(label, n, users, merge_runs(runs[label])))
                    rows[-1]["runs"] = "paired" if paired else "alone"
                    if all(run.get("exact") for run in runs[label]):  # each round's own p50: the spread
                        rows[-1]["p50_by_round_ms"] = " ".join(
                            f"{statistics.median(run['exact']):.2f}" for run in runs[label]
                        )
                    if paired and rows[-1]["mean_ms"]:  # Locust's rate counts both deployments' turns
                        rows[-1]["requests_per_s"] = round(1000 / rows[-1]["mean_ms"], 3)  # the user's alone
                    if timings:
                        rows[-1]["model_ms"] = round(statistics.mean(t[label] for t in timings), 3)
                    if generated[label]:
                        rows[-1]["warmup_output_tokens"] = round(statistics.mean(generated[label]), 1)
                    print(json.dumps(rows[-1]), flush=True)
    stem = write_report(args, rows, info, load_before)
    for label in args.labels[:-1]:
        speedups = [r["speedup_p50"] for r in comparison_rows(rows, (label, args.labels[-1])) if r["speedup_p50"]]
        if speedups:
            print(f"{label}: median p50 speedup over all runs: {statistics.median(speedups):.2f}x")
    print(f"wrote {stem}.{{csv,md,png}}")


if __name__ == "__main__":
    main()
