"""Multi-node training, smoke-tested on one machine: two torchrun agents as two "nodes" on localhost,
meeting through c10d rendezvous, each running one worker of the real trainer on tiny data."""

import json
import os
import re
import socket
import subprocess
import sys

from tests.tiny_data import make_tiny_imdb

TINY_MODEL = ["--n-max", "128", "--k", "16", "--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--d-ff", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_rendezvous_over_c10d_and_train_together(tmp_path):
    data = make_tiny_imdb(tmp_path / "imdb")
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    # As on two hosts: the same command on each, no node rank given; c10d assigns the ranks.
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "smoke",
               "-m", "training", "classify", "--data", str(data), *TINY_MODEL, "--out", str(out),
               "--max-steps", "6", "--epochs", "1", "--max-tokens", "512", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}  # INFO: the agents log their group rank
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(2)]  # fmt: skip
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            node.kill()
    for node, log in zip(nodes, logs, strict=True):
        assert node.returncode == 0, log[-3000:]
    group_ranks = sorted(int(re.search(r"group_rank=(\d+)", log).group(1)) for log in logs)
    assert group_ranks == [0, 1]  # two nodes of one job, not two single-node jobs
    assert all("group_world_size=2" in log for log in logs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 6
