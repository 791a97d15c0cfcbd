"""The service as it runs in production: a uvicorn process on a loopback port, stopped with SIGTERM."""

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not come up:\n{proc.stdout.read()}")


def stop(proc: subprocess.Popen, timeout_s: float = 15) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"server ignored SIGTERM:\n{out}") from None
    return proc.returncode, out


def test_python_m_service_serves_over_http_and_exits_cleanly_on_sigterm(models_dir):
    port = free_port()
    proc = start(["-m", "service", "--models-dir", str(models_dir), "--port", str(port)], port)
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{base}/readyz").status_code == 200
        r = httpx.post(f"{base}/classify", json={"texts": ["the film was great", "bad"]},
                       headers={"x-request-id": "e2e-1"})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        assert r.headers["x-request-id"] == "e2e-1"
        headers = {"content-type": "application/json"}
        big = httpx.post(f"{base}/classify", content=b"x" * (2 << 20), headers=headers)
        assert big.status_code == 413
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert "execution provider: CPUExecutionProvider" in out
    assert "request_id=e2e-1 method=POST path=/classify status=200" in out


def wait_until_queued(port: int, depth: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        queued = [line for line in metrics.splitlines() if line.startswith("linformer_queue_depth{")]
        if queued and float(queued[0].split()[-1]) >= depth:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {depth} texts ever queued")


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(models_dir):
    port = free_port()
    # each batch of two takes 1 s, so six requests are still in flight when SIGTERM arrives
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import SlowRuntime, make_settings
        from service.__main__ import serve
        from service.app import create_app
        settings = make_settings({str(models_dir)!r}, max_batch_size=2, port={port}, log_level="info")
        serve(create_app(settings, wrap_runtime=lambda runtime: SlowRuntime(runtime, 1.0)), settings)
    """)
    proc = start(["-c", script], port)
    results: list[int | str] = []

    def post(text: str) -> None:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/classify", json={"text": text}, timeout=20)
            results.append(r.status_code)
        except httpx.HTTPError as e:
            results.append(repr(e))

    threads = [threading.Thread(target=post, args=(f"the film {i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    wait_until_queued(port, 4)  # all six accepted: at most two computing, the rest queued
    started = time.monotonic()
    code, out = stop(proc)
    for thread in threads:
        thread.join()
    assert results == [200] * 6, out
    assert code == 0, out
    assert "batchers drained" in out
    assert time.monotonic() - started > 1.0  # it waited for the work instead of cutting it off
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)


def test_a_corrupt_bundle_stops_the_server_with_a_clear_error(models_dir, tmp_path):
    import shutil

    bundle = shutil.copytree(models_dir / "classify-linformer", tmp_path / "classify-linformer")
    (bundle / "config.json").write_text((bundle / "config.json").read_text().replace("negative", "bad"))
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "service", "--models-dir", str(tmp_path), "--port", str(port)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode != 0
    assert "refusing to start" in proc.stderr and "config.json does not match manifest.json" in proc.stderr
