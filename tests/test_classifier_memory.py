"""The classifier keeps ORT's CPU arena for speed, yet one big batch must not keep its peak for the life of the
process: after a batch of at least `shrink_from_tokens` padded tokens, `release_memory` (which the compute thread
calls once idle) gives the memory back to the OS; until then the next big batch finds it in the arena."""

from pathlib import Path

import numpy as np
import psutil
import pytest

from service.runtime import CPU, ClassifierRuntime, make_session

BUNDLE = Path(__file__).resolve().parents[1] / "models" / "classify-linformer"
BIG_BATCH = (32, 2048)  # ~500 MB of activations on the committed classify-linformer


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _rss_kept_after_big_batch(released: bool) -> float:
    session = make_session(BUNDLE / "model.onnx", [CPU], intra_op_threads=1, inter_op_threads=1, cpu_mem_arena=True)
    runtime = ClassifierRuntime(session, shrink_from_tokens=4096)
    small = np.full((2, 64), 5, dtype=np.int64)
    for _ in range(3):
        runtime.run(small, np.ones_like(small))
    before = _rss_mb()
    big = np.full(BIG_BATCH, 5, dtype=np.int64)
    runtime.run(big, np.ones_like(big))
    if released:
        runtime.release_memory()
    for _ in range(3):  # normal batches afterwards must not bring the peak back either
        runtime.run(small, np.ones_like(small))
    kept = _rss_mb() - before
    del runtime, session
    return kept


@pytest.mark.skipif(not (BUNDLE / "model.onnx").exists(), reason="needs the committed classify-linformer bundle")
def test_a_big_batch_hands_the_arena_back_when_released_and_small_batches_keep_it():
    # kept until released, measured first: the arena holds the big batch's activations (hundreds of MB)
    assert _rss_kept_after_big_batch(released=False) > 200
    assert _rss_kept_after_big_batch(released=True) < 40
