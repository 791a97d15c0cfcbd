"""Load-test tooling: length-controlled texts, the FLOP bound, the report writers, and a real Locust run."""

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import WORDS, build_tiny_classify_bundle, make_tiny_checkpoint

from loadtest.flops import (
    flop_ratio,
    linformer_layer_flops,
    performer_flop_ratio,
    performer_layer_flops,
    vanilla_layer_flops,
)
from loadtest.texts import Corpus, build_texts, cut_to_pieces, token_count

REPO = Path(__file__).resolve().parents[1]
IMDB = REPO / ".cache" / "data" / "imdb"


def tiny_reviews(path: Path, rows: int = 300) -> Path:
    rng = random.Random(1)
    lines = ["label\ttext"] + [
        f"{rng.randint(0, 1)}\t" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "."
        for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- texts of n tokens ----


@pytest.mark.skipif(not (IMDB / "spm.model").exists(), reason="IMDB data not prepared")
def test_imdb_texts_encode_to_exactly_the_requested_length_with_the_real_tokenizer():
    corpus = Corpus("classify", IMDB / "test.tsv", "text", IMDB / "spm.model", add_bos=True, add_eos=False)
    for n in (17, 128, 1024, 4096):
        texts = build_texts(corpus, n, variants=3)
        assert len(set(texts)) == 3  # different reviews, not one text repeated
        assert [token_count(corpus, t) for t in texts] == [n] * 3


def test_texts_hit_the_length_with_a_tiny_vocabulary_too(models_dir, tmp_path):
    tokenizer = models_dir / "classify-linformer" / "tokenizer.model"  # 120 pieces: many words split
    corpus = Corpus("classify", tiny_reviews(tmp_path / "reviews.tsv"), "text", tokenizer, add_bos=True, add_eos=True)
    for n in (3, 16, 64, 300):
        for text in build_texts(corpus, n):
            assert abs(token_count(corpus, text) - n) <= 1, (n, text)
            assert text == text.strip() and text


@pytest.mark.parametrize("task", ["classify", "translate"])
def test_committed_texts_have_exactly_their_length_with_the_committed_bundles_tokenizer(task):
    from loadtest.texts import DATA, corpus_for, tokenizer_sha256

    stored = json.loads((DATA / f"{task}.json").read_text())
    corpus = corpus_for(task)  # the committed bundle's tokenizer and specials
    assert stored["tokenizer_sha256"] == tokenizer_sha256(corpus), "bundle tokenizer changed: python -m loadtest.texts"
    assert stored["source"]["split"] == "test.tsv"  # held-out texts only
    for n, texts in stored["texts"].items():
        assert len(set(texts)) == stored["variants"] == 4
        assert [token_count(corpus, t) for t in texts] == [int(n)] * 4


def test_locust_texts_need_no_training_data(tmp_path, monkeypatch):
    from loadtest import texts

    monkeypatch.setattr(texts, "CACHE", tmp_path / "empty-cache")
    monkeypatch.setenv("LOADTEST_CLASSIFY_DATA", str(tmp_path / "no-such.tsv"))
    texts.texts_of_length.cache_clear()
    try:
        assert len(texts.texts_of_length("classify", 512)) == 4  # from loadtest/data/classify.json
        with pytest.raises(FileNotFoundError, match="has lengths \\[128, 256, 512"):
            texts.texts_of_length("classify", 300)  # not committed, and no data to cut it from
    finally:
        texts.texts_of_length.cache_clear()


@pytest.mark.skipif(not (IMDB / "meta.json").exists(), reason="IMDB data not prepared")
def test_committed_classify_texts_come_from_the_prepared_test_split():
    from loadtest.texts import DATA

    source = json.loads((DATA / "classify.json").read_text())["source"]
    meta = json.loads((IMDB / "meta.json").read_text())
    assert source["split_sha256"] == meta["sha256"]["test.tsv"]
    assert source["packages"][0]["version"] == meta["package_version"]


def test_the_cut_lands_mid_word_when_no_word_boundary_gives_the_count():
    encode = list  # one piece per character
    joined = "abcdef ghijkl mnopqr"
    assert cut_to_pieces(encode, joined, 10) == "abcdef ghi"
    assert len(encode(cut_to_pieces(encode, joined, 13))) == 13
    with pytest.raises(ValueError):
        cut_to_pieces(encode, joined, 100)


# ---- the FLOP bound ----


def test_flop_counts_match_a_hand_computed_layer():
    # n=8, d=2, d_ff=8, k=4. Vanilla: QKVO 8·8·4 = 256, attention 4·64·2 = 512, FFN 4·8·2·8 = 512.
    assert vanilla_layer_flops(8, 2, 8) == 1280
    # Linformer, input first: QO 4·8·4 = 128, E·X 2·8·4·2 = 128, KV on k rows 4·4·4 = 64,
    # attention 4·8·4·2 = 256, FFN 512.
    assert linformer_layer_flops(8, 2, 8, 4) == 1088
    # Paper order: QKVO 256, E·K and F·V 2·2·8·4·2 = 256, attention 256, FFN 512.
    assert linformer_layer_flops(8, 2, 8, 4, input_first=False) == 1280
    # The served size at n = 4096, k = 128.
    assert vanilla_layer_flops(4096, 128, 512) == 10_200_547_328
    assert linformer_layer_flops(4096, 128, 512, 128) == 1_753_219_072
    assert flop_ratio(4096, 128, 512, 128) == pytest.approx(5.818, abs=1e-3)


def test_performer_flop_count_matches_a_hand_computed_layer():
    # n=8, d=4, d_ff=8, M=3, 2 heads. QKVO 8·8·16 = 1024; features 4·8·4·3 = 384; φ(K)ᵀ[V 1] and
    # φ(Q)·(φ(K)ᵀ[V 1]) 4·8·3·(4 + 2) = 576; FFN 4·8·4·8 = 1024.
    assert performer_layer_flops(8, 4, 8, 3, 2) == 3008
    # The served size (M = 128, 4 heads): the attention is 8·n·d·M, against the vanilla 4·n²·d, so the bound
    # grows about linearly in n once attention dominates: 1.74 at 1024, 8.72 at 8192.
    assert performer_flop_ratio(1024, 128, 512, 128, 4) == pytest.approx(939524096 / 538968064, abs=1e-6)
    assert performer_flop_ratio(8192, 128, 512, 128, 4) == pytest.approx(37580963840 / 4311744512, abs=1e-6)


def test_compressing_the_input_first_never_costs_more_than_the_papers_order():
    for n in (512, 2048, 8192):
        for k in (64, 128, 256):
            assert flop_ratio(n, 256, 1024, k) >= flop_ratio(n, 256, 1024, k, input_first=False)


# ---- report writers ----


def sweep_row(deployment, n, users, p50, rps):
    return {"deployment": deployment, "n": n, "users": users, "requests": 10, "failures": 0,
            "requests_per_s": rps, "p50_ms": p50, "p95_ms": 2 * p50, "p99_ms": 3 * p50, "mean_ms": p50,
            "load_average_1min": 1.0}  # fmt: skip


def test_sweep_report_has_a_speedup_per_length(tmp_path):
    from loadtest import sweep

    rows = [sweep_row("linformer", 1024, 1, 20.0, 50.0), sweep_row("transformer", 1024, 1, 60.0, 16.0),
            sweep_row("linformer", 4096, 1, 50.0, 20.0), sweep_row("transformer", 4096, 1, 400.0, 2.5)]  # fmt: skip
    rows[0]["model_ms"], rows[1]["model_ms"] = 10.0, 40.0  # timed by the sweep at n = 1024 only
    table = sweep.comparison_rows(rows, ("linformer", "transformer"), {1024: 3.5, 4096: 9.0})
    assert [(r["n"], r["speedup_p50"], r["throughput_ratio"]) for r in table] == [(1024, 3.0, 3.12), (4096, 8.0, 8.0)]
    # the share is taken against the same-time timing where there is one, else against Table 3
    assert [(r["table3_speedup"], r["model_level_speedup"], r["e2e_over_model"]) for r in table] == [
        (3.5, 4.0, 0.75), (9.0, 9.0, 0.889)]
    args = argparse.Namespace(task="classify", labels=["linformer", "transformer"], out=tmp_path, suffix="",
                              spawn=False, duration="5s", warmup=1, model_seconds=10, rounds=1,
                              paired=True)  # fmt: skip
    info = {"linformer": {"base": "http://a", "model": "m1"}, "transformer": {"base": "http://b", "model": "m2"}}
    stem = sweep.write_report(args, rows, info, "0 / 0 / 0")
    markdown = stem.with_suffix(".md").read_text()
    assert "| speedup p50 |" in markdown
    assert "| 4096 | 50 | 100 | 150 | 20 | 400 | 800 | 1200 | 2.5 | 8 |" in markdown
    with open(stem.with_suffix(".csv"), newline="") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert stem.with_suffix(".png").stat().st_size > 0


def test_sweep_report_compares_each_deployment_with_the_last_named_when_there_are_three(tmp_path):
    from loadtest import sweep

    rows = [sweep_row("linformer", 1024, 1, 20.0, 50.0), sweep_row("performer", 1024, 1, 25.0, 40.0),
            sweep_row("transformer", 1024, 1, 60.0, 16.0)]  # fmt: skip
    args = argparse.Namespace(task="classify", labels=["linformer", "performer", "transformer"], out=tmp_path,
                              suffix="", spawn=False, duration="5s", warmup=1, model_seconds=10, rounds=1,
                              paired=True)  # fmt: skip
    info = {label: {"base": "http://a", "model": label} for label in args.labels}
    markdown = sweep.write_report(args, rows, info, "0 / 0 / 0").with_suffix(".md").read_text()
    assert "linformer / performer vs transformer deployments" in markdown
    assert "## 1 user — linformer vs transformer" in markdown and "## 1 user — performer vs transformer" in markdown
    assert "| 1024 | 25 | 50 | 75 | 40 | 60 | 120 | 180 | 16 | 2.4 |" in markdown  # 60 / 25


def test_table3_report_puts_measured_speedup_beside_the_paper(tmp_path, monkeypatch):
    from loadtest import table3

    monkeypatch.setattr(table3, "RESULTS", tmp_path)
    rows = [{"size": "served", "n": n, "k": 128, "vanilla_ms": v, "linformer_ms": 10.0, "speedup": v / 10.0,
             "paper_speedup": table3.PAPER_SPEEDUP_K128[n], "flop_ratio": 2.0, "flop_ratio_paper_order": 1.5,
             "vanilla_peak_mib": 40.0, "linformer_peak_mib": 10.0, "memory_saving": 4.0, "vanilla_max_batch": "8",
             "linformer_max_batch": "64", "m": 128, "performer_ms": 12.0, "performer_speedup": v / 12.0,
             "performer_flop_ratio": 1.8, "performer_peak_mib": 8.0, "performer_memory_saving": 5.0,
             "performer_max_batch": "32", "vanilla_cpu_ms": v / 2, "linformer_cpu_ms": 5.0, "performer_cpu_ms": 6.0,
             "cpu_speedup": v / 10.0, "performer_cpu_speedup": v / 12.0, "runs": 5, "load_average_1min": 1.0}
            for n, v in ((2048, 30.0), (4096, 60.0))]  # fmt: skip
    args = argparse.Namespace(ks=[128], lengths=[2048, 4096], threads=1, reps=5, min_reps=3, seconds_per_length=9,
                              budget_gib=2.0, probe_seconds=9, max_batch=64, projection="linear",
                              suffix="")  # fmt: skip
    models = {"vanilla": {"fused": {"MultiHeadAttention": 2}}, "linformer-k128": {"fused": {"MultiHeadAttention": 2}},
              "performer": {"fused": {}, "m": 128}}
    table3.write_report(args, "served", rows, models, "0 / 0 / 0")
    markdown = (tmp_path / "table3-served.md").read_text()
    assert "| n | k | vanilla ms | Linformer ms | speedup | paper speedup (V100) |" in markdown
    assert "| 4096 | 128 | 60 | 10 | 6 | 3.4 |" in markdown
    assert "MultiHeadAttention" in markdown
    # the three kinds side by side: times, then each speedup beside its own FLOP bound, then memory
    assert "| n | vanilla ms | Linformer ms (k 128) | Performer ms (M 128) | Linformer speedup |" in markdown
    assert "| 4096 | 60 | 10 | 12 | 6 | 2 | 5 | 1.8 | 40 | 10 | 8 | 4 | 5 | 8 | 64 | 32 | 1 |" in markdown
    assert "| 4096 | 30 | 5 | 6 | 6 | 2 | 5 | 1.8 | 1 |" in markdown  # the same by CPU time


# ---- Locust against a real service ----


def test_locust_lists_every_user_class_of_the_folder():
    done = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/", "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ClassifyUser" in done.stdout and "TranslateUser" in done.stdout


def test_headless_locust_run_gets_exact_lengths_from_a_real_service(models_dir, tmp_path):
    port = free_port()
    # a classify-only deployment (empty translate model): /readyz waits for every configured model
    env = {**os.environ, "LINFORMER_MODELS_DIR": str(models_dir), "LINFORMER_LOG_LEVEL": "warning",
           "LINFORMER_TRANSLATE_MODEL": "",
           "LINFORMER_ORT_INTRA_OP_THREADS": "1", "LOADTEST_LENGTHS": "16,64", "LOADTEST_CACHE": str(tmp_path),
           "LOADTEST_CLASSIFY_DATA": str(tiny_reviews(tmp_path / "reviews.tsv"))}  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "service did not come up"
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtest/", "ClassifyUser", "--headless", "-u", "2", "-r", "2",
             "-t", "3s", "--host", base, "--csv", str(tmp_path / "run"), "--only-summary"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        # one user for two deployments (here the same server under two names): each text goes to both
        paired = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtest/", "PairedClassifyUser", "--headless", "-u", "1",
             "-r", "1", "-t", "2s", "--csv", str(tmp_path / "paired"), "--only-summary"],
            cwd=REPO, env={**env, "LOADTEST_LENGTHS": "16", "LOADTEST_PAIRED_HOSTS": f"a={base},b={base}"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    with open(tmp_path / "run_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    for n in (16, 64):
        row = stats[f"/classify n={n}"]  # one percentile row per length
        assert int(row["Request Count"]) > 0, done.stderr[-2000:]
        # a reply whose `tokens` differs from n is a failure, so this also checks the lengths
        assert int(row["Failure Count"]) == 0, done.stderr[-2000:]
    with open(tmp_path / "paired_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    counts = [int(stats[f"/classify n=16 {label}"]["Request Count"]) for label in "ab"]
    assert min(counts) > 0 and abs(counts[0] - counts[1]) <= 1, paired.stderr[-2000:]  # one each, in turn
    assert all(int(stats[f"/classify n=16 {label}"]["Failure Count"]) == 0 for label in "ab")


def test_sweep_percentiles_come_from_the_exact_times_when_locust_wrote_them():
    from loadtest import sweep

    locust = {"Request Count": "100", "Failure Count": "0", "Requests/s": "50", "50%": "9", "95%": "10",
              "99%": "11", "Average Response Time": "9.1"}  # fmt: skip
    assert sweep.to_row("linformer", 1024, 1, locust)["p50_ms"] == 9.0  # no exact times: Locust's rounded ones
    exact = [8.0 + i / 100 for i in range(101)]  # 8.00 ... 9.00 ms, which Locust would call 8 or 9
    row = sweep.to_row("linformer", 1024, 1, {**locust, "exact": exact})
    assert (row["p50_ms"], row["p95_ms"], row["p99_ms"], row["mean_ms"]) == (8.5, 8.95, 8.99, 8.5)
    assert row["percentiles"] == "exact (101 requests)"


@pytest.mark.slow
def test_sweep_spawns_both_deployments_and_writes_the_report(tmp_path):
    from export.classify import export_classifier

    models = tmp_path / "models"
    build_tiny_classify_bundle(models / "classify-linformer")
    checkpoint, tokenizer = make_tiny_checkpoint(tmp_path / "transformer-source", attention="transformer")
    export_classifier(checkpoint, tokenizer, models / "classify-transformer", "classify-transformer")
    env = {**os.environ, "LOADTEST_CACHE": str(tmp_path / "cache"),
           "LOADTEST_CLASSIFY_DATA": str(tiny_reviews(tmp_path / "reviews.tsv"))}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.sweep", "--spawn", "--models-dir", str(models), "--lengths", "16,64",
         "--users", "1", "--duration", "2s", "--rounds", "2", "--warmup", "1", "--model-seconds", "1",
         "--out", str(tmp_path / "results")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "results" / "sweep-classify.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    expected = {(d, n) for d in ("linformer", "transformer") for n in ("16", "64")}
    assert {(r["deployment"], r["n"]) for r in rows} == expected
    assert all(int(r["requests"]) > 0 and int(r["failures"]) == 0 for r in rows)
    assert all(float(r["model_ms"]) > 0 for r in rows)  # both bundles timed alone at each length
    # one user: one paired run per round; each deployment's rate is the user's alone, 1 / mean latency
    assert all(r["runs"] == "paired" for r in rows)
    assert all(float(r["requests_per_s"]) == pytest.approx(1000 / float(r["mean_ms"]), rel=0.01) for r in rows)
    # every request timed; Locust's CSV is rewritten once a second, so its count may miss the last one
    exact = [int(re.fullmatch(r"exact \((\d+) requests\)", r["percentiles"]).group(1)) for r in rows]
    assert all(timed >= int(r["requests"]) for timed, r in zip(exact, rows, strict=True))
    markdown = (tmp_path / "results" / "sweep-classify.md").read_text()
    assert "speedup p50" in markdown and "taskset" in markdown


def test_table3_gpu_runs_every_kind_on_the_cpu_and_reports_ratios_of_its_own_timings(tmp_path):
    import csv

    from loadtest import table3_gpu

    stem = table3_gpu.main(["--device", "cpu", "--size", "served", "--lengths", "32,64", "--ks", "8,16", "--tokens",
                            "128", "--reps", "2", "--dtype", "float32", "--out", str(tmp_path)])  # fmt: skip
    rows = list(csv.DictReader(stem.with_suffix(".csv").open()))
    assert [(int(r["n"]), int(r["k"]), int(r["batch"])) for r in rows] == [(32, 8, 4), (32, 16, 4), (64, 8, 2),
                                                                          (64, 16, 2)]  # fmt: skip
    for r in rows:
        # the ratios come from the unrounded times: equal to the CSV's rounded ones within the last digit
        assert abs(float(r["speedup"]) - float(r["vanilla_ms"]) / float(r["linformer_ms"])) < 0.011
        assert abs(float(r["speedup_vs_math"]) - float(r["vanilla_math_ms"]) / float(r["linformer_ms"])) < 0.011
        assert r["vanilla_peak_mib"] == "" and r["linformer_max_batch"] == ""  # memory is measured on CUDA only
    assert "device: cpu" in stem.with_suffix(".md").read_text() and stem.with_suffix(".png").stat().st_size > 0
