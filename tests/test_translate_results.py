"""benchmarks/translate_results.py: a new run's rows join the committed ones; earlier rows are not lost."""

import csv
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIG = {"attention": "linformer", "cross_attention": "transformer", "k": 32, "k_cross": 32, "d_model": 128,
          "n_layers": 3, "n_decoder_layers": 3, "n_heads": 4, "d_ff": 512, "dropout": 0.1, "n_max": 256,
          "tgt_n_max": 256, "projection_init": "mean"}  # fmt: skip
TRAIN = {"lr": 0.001, "warmup_steps": 200, "max_tokens": 4096, "max_steps": 3000, "epochs": 6, "seed": 1234,
         "threads": 2}  # fmt: skip


def fake_run(root: Path, name: str, cfg: dict, bleu: float) -> Path:
    run = root / name
    run.mkdir(parents=True)
    summary = {"steps": 3000, "train_wall_s": 1500.0, "threads_per_process": 2, "parameters": 2_429_440,
               "dev": {"ppl": 35.0}, "test": {"ppl": 34.0}, "model_config": cfg, "train_config": TRAIN}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    evaluation = {"beam_size": 1, "bleu": bleu, "chrf": 34.0, "decode_s": 6.0, "decode_ms_per_sentence": 4.0,
                  "threads": 1, "bleu_signature": "nrefs:1|bleu", "chrf_signature": "nrefs:1|chrf"}  # fmt: skip
    (run / "eval-test-beam1.json").write_text(json.dumps(evaluation))
    return run


def results(out: Path, *args: str) -> list[dict]:
    subprocess.run([sys.executable, "benchmarks/translate_results.py", *args, "--out", str(out)], cwd=REPO,
                   check=True, capture_output=True)  # fmt: skip
    with out.with_suffix(".csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_later_run_adds_its_rows_and_a_rerun_replaces_its_own(tmp_path):
    out = tmp_path / "results" / "translate.md"
    transformer = fake_run(tmp_path / "a", "translate-transformer", {**CONFIG, "attention": "transformer"}, 10.0)
    results(out, str(transformer), "--trained", "alone, 2 threads")
    linformer = fake_run(tmp_path / "b", "translate-linformer-k32", CONFIG, 10.5)
    rows = results(out, str(linformer))  # the transformer's run dir is gone from the command line: kept
    assert [(r["model"], r["bleu"], r["trained"]) for r in rows] == [
        ("Linformer k=32, full cross-attention", "10.5", "2 torch thread(s)"),
        ("Transformer", "10.0", "alone, 2 threads"),
    ]
    rerun = fake_run(tmp_path / "c", "translate-linformer-k32", CONFIG, 11.0)
    assert [r["bleu"] for r in results(out, str(rerun))] == ["11.0", "10.0"]
    markdown = out.read_text()
    assert "| Linformer k=32, full cross-attention | 35.0 | 11.0 |" in markdown
    assert "Same recipe and budget for all: d_model 128" in markdown and "(`nrefs:1|bleu`" in markdown


def test_timing_runs_get_their_own_table(tmp_path):
    out = tmp_path / "translate.md"
    results(out, str(fake_run(tmp_path / "a", "translate-transformer", {**CONFIG, "attention": "transformer"}, 10.0)))
    rows = results(out, str(fake_run(tmp_path / "b", "timing-k32", CONFIG, 0.1)), "--timing", "--trained", "alone")
    assert [r["kind"] for r in rows] == ["timing", "result"]
    markdown = out.read_text()
    assert "| Linformer k=32, full cross-attention | 3000 | 1500 s | 0.500 | alone |" in markdown
    assert "| Linformer k=32, full cross-attention | 35.0 | 0.1 |" not in markdown  # not among the results
