"""benchmarks/translate_load.py's accounting: what counts towards throughput and which requests are short."""

from benchmarks.translate_load import Record, goals, summarise


def test_throughput_counts_only_replies_within_the_run_and_short_means_at_most_32_tokens():
    records = [
        Record(n=8, sent_s=0.0, latency_s=0.010, status=200, tokens=5, in_window=True),
        Record(n=32, sent_s=1.0, latency_s=0.030, status=200, tokens=20, in_window=True),
        # answered after its recorded window (closed_loop marks it): a latency, but not throughput
        Record(n=64, sent_s=1.5, latency_s=0.900, status=200, tokens=40, in_window=False),
        Record(n=16, sent_s=1.2, latency_s=0.005, status=503, tokens=0, in_window=True),
        # sent in the warm-up, answered in the window: throughput, but not a latency or a request of the window
        Record(n=256, sent_s=-0.3, latency_s=0.500, status=200, tokens=90, in_window=True),
    ]
    row, buckets = summarise("ours-request-fp32", 4, 2.0, records, "load")
    assert row["generated_tokens_per_s"] == (5 + 20 + 90) / 2.0 and row["requests"] == 4
    assert row["errors"] == 1 and row["short_requests"] == 2  # the 503 is neither short nor a latency
    assert row["short_p99_ms"] <= 30.0 < row["p99_ms"]
    assert [b["n"] for b in buckets] == [8, 16, 32, 64] and buckets[1]["requests"] == 0


def test_goals_compare_only_deployments_measured_in_the_same_run():
    rows = [{"deployment": d, "users": u, "generated_tokens_per_s": tps, "short_p99_ms": p99}
            for d, u, tps, p99 in [("ours-step-fp32", 1, 100, 10), ("ours-step-fp32", 16, 300, 15),
                                   ("ours-request-fp32", 16, 150, 40)]]  # fmt: skip
    lines = goals(rows)
    assert any("step-level / request-level throughput at 16 users: **2.000×** (goal ≥ 1.5×): met" in line
               for line in lines)  # fmt: skip
    assert any("at 16 users / at 1 user: **1.500×** (goal ≤ 2×): met" in line for line in lines)
    assert not any("ct2" in line for line in lines)  # no peer in this run: no claim about it


def test_a_goal_is_judged_on_the_unrounded_ratio():
    # the fifteenth session's single stream: 1,622.4 against 2,038.9 tokens/s is 0.7957, which two decimals print 0.80
    rows = [{"deployment": d, "users": 1, "generated_tokens_per_s": tps, "short_p99_ms": 20.0}
            for d, tps in [("ours-request-fp32", 1622.4), ("ct2-fp32", 2038.9)]]  # fmt: skip
    [line] = [line for line in goals(rows) if "single stream" in line]
    assert "**0.796×** (goal ≥ 0.8×): **missed**" in line
