"""Fuzz the API from its own OpenAPI with schemathesis: every check, 0 5xx and 0 schema violations wanted.

    python -m benchmarks.fuzz [--max-examples 1000] [--seed 1] [--out benchmarks/results]

Serves the committed bundles (`python -m service`, both tasks, 1 ORT thread) on a free port, runs
`schemathesis run --checks all` with benchmarks/schemathesis.toml (413 and 429 are accepted answers to
schema-valid requests: token lengths and the decode budget cannot be stated in JSON schema), and writes
fuzz.{csv,md}: cases generated, failures by check, the status codes seen. Needs the `fuzz` extra.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# One worker: every 2-worker run of the ninth session ended in "SystemError: AST constructor recursion depth
# mismatch" inside hypothesis, most likely its two threads building ASTs at once (CPython 3.11 keeps that recursion
# count per interpreter, not per thread: cpython gh-106905); 3 of 3 one-worker runs were clean.
WORKERS = 1

from benchmarks.loadgen import Server, free_port  # noqa: E402
from loadtest.report import header, load_average, write_csv, write_markdown  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=1000, help="per API operation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if schemathesis is None:
        sys.exit("schemathesis is not installed: pip install -e '.[fuzz]'")
    load_before = load_average()
    port = free_port()
    server = Server(port, {"LINFORMER_ORT_INTRA_OP_THREADS": "1", "LINFORMER_LOG_LEVEL": "warning"}, cores=None)
    with tempfile.TemporaryDirectory() as reports:
        command = [
            schemathesis, "--config-file", str(REPO / "benchmarks" / "schemathesis.toml"), "run",
            f"http://127.0.0.1:{port}/openapi.json", "--checks", "all", "--max-examples", str(args.max_examples),
            "--seed", str(args.seed), "--workers", str(WORKERS), "--request-timeout", "60", "--no-color",
            "--report", "ndjson", "--report-dir", reports, "--generation-database", "none",
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        finally:
            exit_code = server.stop()
        statuses = collections.Counter()
        for path in Path(reports).glob("*.ndjson"):
            for line in path.read_text().splitlines():
                for match in re.finditer(r'"status_code":\s*(\d{3})', line):
                    statuses[int(match.group(1))] += 1
    output = done.stdout + done.stderr
    generated = re.search(r"(\d+) generated", output)
    cases = int(generated.group(1)) if generated else 0
    failures = re.findall(r"❌ (ST\d+ [^:\n]+): (\d+)", output)
    # schemathesis prints failures and errors in their own sections before the summary: keep those too
    first = min((output.find(h) for h in (" ERRORS ", " FAILURES ", "SUMMARY") if h in output), default=-1)
    summary = output[first:] if first >= 0 else output[-3000:]
    # an internal error of schemathesis can print whole source files inside one line of its traceback
    summary = "\n".join(line if len(line) <= 300 else line[:300] + " [...]" for line in summary.splitlines())
    rows = [{"status": status, "responses": count} for status, count in sorted(statuses.items())]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "fuzz.csv", rows)
    five_xx = sum(count for status, count in statuses.items() if status >= 500)
    lines = header("Fuzzing the OpenAPI with schemathesis", ("schemathesis", "fastapi", "pydantic"), load_before)
    lines += [
        f"`schemathesis run --checks all --max-examples {args.max_examples} --seed {args.seed} --workers {WORKERS}` "
        "with [`schemathesis.toml`](../schemathesis.toml) against `python -m service` (the committed classify and "
        "translate bundles, default settings, 1 ORT thread).",
        "",
        f"- test cases generated: **{cases}** (goal >= 2,000)",
        f"- failures: **{sum(int(n) for _, n in failures)}** "
        + (", ".join(f"{name} x{n}" for name, n in failures) if failures else "(none)"),
        f"- responses with a 5xx status: **{five_xx}**; schemathesis exit code {done.returncode}; "
        f"server exit code on SIGTERM {exit_code}",
        "",
        "| status | responses |",
        "|---|---|",
        *[f"| {row['status']} | {row['responses']} |" for row in rows],
        "",
        "schemathesis's summary:",
        "",
        "```",
        summary.strip(),
        "```",
        "",
    ]
    write_markdown(args.out / "fuzz.md", lines)
    sys.exit(0 if done.returncode == 0 and cases >= 2000 and five_xx == 0 else 1)


if __name__ == "__main__":
    main()
