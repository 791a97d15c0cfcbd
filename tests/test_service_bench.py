"""benchmarks/service_bench.py's floor (issue #20): the bare server answers as the model does, in batches, and each
goal's line says where the floor stands."""

import http.client
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.loadgen import free_port, wait_until_ready
from benchmarks.peers.classify_model import BundleClassifier
from benchmarks.service_bench import FLOOR, goals

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "models" / "classify-linformer"
TEXTS = ["A moving, beautifully acted film.", "Dull, far too long, and the jokes fall flat.",
         "The best thing I have seen this year.", "I walked out after half an hour."] * 4  # fmt: skip


@pytest.fixture(scope="module")
def floor_port():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "benchmarks/peers/floor_classify.py", "--bundle", str(BUNDLE), "--port",
                             str(port), "--max-batch", "4"], cwd=REPO)  # fmt: skip
    try:
        wait_until_ready(proc, port)  # (the floor answers any GET with 200)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics")
    lines = conn.getresponse().read().decode().splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines)}


def test_the_floor_answers_each_text_with_the_models_label_in_batches(floor_port):
    expected = [result["label"] for result in BundleClassifier(str(BUNDLE)).classify(TEXTS)]
    before = _metrics(floor_port)

    def two_on_one_connection(pair: tuple[str, str]) -> list[str]:  # keep-alive: one after the other
        conn = http.client.HTTPConnection("127.0.0.1", floor_port, timeout=30)
        labels = []
        for text in pair:
            conn.request("POST", "/classify", json.dumps({"text": text}), {"content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            labels.append(json.loads(response.read())["label"])
        return labels

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(two_on_one_connection, zip(TEXTS[::2], TEXTS[1::2], strict=True)))
    assert [label for pair in answers for label in pair] == expected
    assert set(expected) == {"positive", "negative"}  # the texts tell the labels apart, so a fixed answer fails
    after = _metrics(floor_port)
    texts = after["floor_batch_size_sum"] - before["floor_batch_size_sum"]
    batches = after["floor_batch_size_count"] - before["floor_batch_size_count"]
    assert texts == len(TEXTS)
    assert len(TEXTS) / 4 <= batches <= len(TEXTS)  # never more than --max-batch 4 texts in one


def _row(server: str, connections: int, **figures: float) -> dict:
    return {"server": server, "connections": connections, "rps": 100.0, "p99_ms": 10.0, **figures}


def test_each_goal_says_whether_the_floor_meets_it():
    model = {"batch1_p50_ms": 1.0, "best_rate": 100.0}
    results = {
        64: {"model": model, "rows": [
            _row("this service", 1, p50_ms=1.5), _row(FLOOR, 1, p50_ms=1.1),
            _row("this service", 64, ratio_to_model=0.8, cpu_ms_outside_run=0.2),
            _row(FLOOR, 64, ratio_to_model=0.9, cpu_ms_outside_run=0.1),
        ]},
        512: {"model": model, "rows": [
            _row("this service", 64, ratio_to_model=0.86, cpu_ms_outside_run=0.9),
            _row(FLOOR, 64, ratio_to_model=0.88, cpu_ms_outside_run=0.6),
        ]},
    }  # fmt: skip
    lines = goals(results)
    line = {key: next(line for line in lines if line.startswith(key)) for key in
            ("- 64 tokens, 64 connections: 0.80", "- 64 tokens, 1 connection", "- 64 tokens, 64 connections: CPU",
             "- 512 tokens, 64 connections: CPU", "- 512 tokens, 64 connections: 0.86")}  # fmt: skip
    assert "**missed**; the floor 0.900, within the goal" in line["- 64 tokens, 64 connections: 0.80"]
    assert "(overhead 0.500 ms; the floor 0.100 ms, within the goal)" in line["- 64 tokens, 1 connection"]
    assert "the floor 0.100 ms, within the goal" in line["- 64 tokens, 64 connections: CPU"]
    assert "the floor 0.600 ms, **outside it too**" in line["- 512 tokens, 64 connections: CPU"]
    assert "the floor 0.880, **outside it too**" in line["- 512 tokens, 64 connections: 0.86"]
    assert all("floor" not in line for line in goals({64: {"model": model, "rows": results[64]["rows"][::2]}}))
