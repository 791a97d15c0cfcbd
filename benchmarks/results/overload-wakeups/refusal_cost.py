"""What one refusal costs the server's core in bulk (the first table of README.md here).

    python benchmarks/results/overload-wakeups/refusal_cost.py   # from the repository root; needs wrk and perf

The overload set-up (`classify_server_on_core_0`: 1 ORT thread, server on core 0, this process and wrk on core 1),
admitting one request at a time and refusing the rest; wrk at full speed for 10 s. Prints the /classify answers by
status (from /metrics), the server's CPU ticks (utime + stime, 100 per second) over those 10 s, and a `perf record`
split of the server's samples by library during a second wrk run.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks.flood_syscalls import answered  # noqa: E402
from benchmarks.loadgen import REVIEW, classify_server_on_core_0  # noqa: E402

REFUSE_ALL_BUT_ONE = ["LINFORMER_MAX_CONCURRENT_REQUESTS=1", "LINFORMER_MAX_WAITING_REQUESTS=0",
                      "LINFORMER_SHED_CONCURRENT_REQUESTS=1"]  # fmt: skip


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def main() -> None:
    server = classify_server_on_core_0("classify-linformer", REFUSE_ALL_BUT_ONE)  # pins this process to core 1
    pid, url = server.proc.pid, f"http://127.0.0.1:{server.port}/classify"
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        body = json.dumps({"text": REVIEW})
        script.write(f'wrk.method = "POST"\nwrk.body = [[{body}]]\nwrk.headers["Content-Type"] = "application/json"\n')
        script.flush()

        def wrk(seconds: int, **kwargs) -> subprocess.Popen:
            return subprocess.Popen(["wrk", "-t1", "-c64", f"-d{seconds}s", "-s", script.name, url], **kwargs)

        try:
            wrk(4, stdout=subprocess.DEVNULL).wait()  # warm-up
            before, ticks = answered(server.port), cpu_ticks(pid)
            wrk(10).wait()
            print(f"cpu ticks (utime + stime) during 10 s: {cpu_ticks(pid) - ticks}")
            print(f"/classify answers by status, before: {before}, after: {answered(server.port)}")
            load = wrk(12, stdout=subprocess.DEVNULL)
            with tempfile.NamedTemporaryFile(suffix=".perf") as data:
                subprocess.run(["perf", "record", "-F", "2000", "-g", "-p", str(pid), "-o", data.name, "--", "sleep",
                                "6"], check=True, capture_output=True)  # fmt: skip
                load.wait()
                subprocess.run(["perf", "report", "-i", data.name, "--no-children", "--sort", "dso", "-q", "-g",
                                "none"], check=True)  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
