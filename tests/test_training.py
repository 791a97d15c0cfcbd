"""The trainer: bucketing, a real (tiny) training run, resume, and DistributedDataParallel on 2 CPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_data import make_tiny_imdb
from training.__main__ import main as training_main
from training.batching import bucketed_batches

TINY_MODEL = [
    "--n-max",
    "128",
    "--k",
    "16",
    "--d-model",
    "32",
    "--n-heads",
    "2",
    "--n-layers",
    "2",
    "--d-ff",
    "64",
]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return make_tiny_imdb(tmp_path_factory.mktemp("imdb"))


def test_bucketed_batches_cover_every_example_once_within_the_token_budget():
    lengths = [(i * 37) % 500 + 1 for i in range(1000)]
    for seed in (None, 3):
        batches = bucketed_batches(lengths, max_tokens=2048, max_batch=64, seed=seed)
        assert sorted(i for b in batches for i in b) == list(range(1000))
        for b in batches:
            assert len(b) <= 64
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 2048
    assert bucketed_batches(lengths, 2048, 64, seed=3) == bucketed_batches(lengths, 2048, 64, seed=3)
    assert bucketed_batches(lengths, 2048, 64, seed=3) != bucketed_batches(lengths, 2048, 64, seed=4)


def test_classifier_learns_the_tiny_task_and_resumes(tiny_data, tmp_path):
    out = tmp_path / "run"
    args = ["classify", "--data", str(tiny_data), *TINY_MODEL, "--out", str(out), "--lr", "5e-3",
            "--warmup-steps", "5", "--max-tokens", "1024", "--threads", "1", "--save-every", "10"]  # fmt: skip
    training_main([*args, "--epochs", "12"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test"]["accuracy"] >= 0.75, summary["test"]  # chance is 0.5
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "dev_accuracy" in r] == list(range(1, 13))
    assert {"best.pt", "last.pt"} <= {p.name for p in out.iterdir()}

    # Resume: asking for more epochs continues from the saved step instead of starting over.
    training_main([*args, "--epochs", "13", "--resume"])
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["epochs_completed"] == 13
    assert resumed["steps"] > summary["steps"]


def test_training_runs_under_torchrun_with_two_cpu_processes(tiny_data, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "training", "classify", "--data", str(tiny_data), *TINY_MODEL, "--out", str(out),
           "--max-steps", "6", "--epochs", "1", "--max-tokens", "512", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2
    assert summary["steps"] == 6
