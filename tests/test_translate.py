"""Translation: the task, greedy and beam decoding with the cache, and the ONNX export, on a tiny synthetic
EN->DE task (number words, training/ende.py's file layout) that a small Linformer learns in seconds."""

import json

import numpy as np
import onnx
import pytest
import torch
from conftest import build_tiny_translate_bundle
from onnx import helper
from tiny_ende import make_tiny_ende

from export.step_decoder import bind_cross
from export.translate import cache_names, export_translator, load_translator, sessions
from model import ModelConfig
from service.runtime import TranslatorRuntime
from training.__main__ import main as training_main
from training.average import average_checkpoints, kept_checkpoints
from training.batching import pad
from training.decode import banned_tokens, beam_search, greedy, length_limits
from training.provenance import sha256_of as sha256
from training.recover_translate import recover
from training.tokenizer import BOS_ID, EOS_ID, PAD_ID
from training.translate import TranslateTask

TINY_TRANSLATOR = [
    "--attention", "linformer", "--k", "8", "--k-cross", "8", "--n-max", "16", "--tgt-n-max", "16",
    "--d-model", "64", "--n-heads", "2", "--n-layers", "1", "--n-decoder-layers", "1", "--d-ff", "128",
    "--dropout", "0.0",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Linformer translator trained for a few seconds through the CLI: (task, run directory)."""
    root = tmp_path_factory.mktemp("translate")
    data = make_tiny_ende(root / "data", rows=2000)
    run = root / "run"
    training_main(["translate", "--data", str(data), *TINY_TRANSLATOR, "--epochs", "10", "--lr", "3e-3",
                   "--warmup-steps", "30", "--max-tokens", "512", "--max-batch", "32", "--threads", "1",
                   "--out", str(run)])  # fmt: skip
    model, saved = load_translator(run / "best.pt")
    task = TranslateTask(data, ModelConfig(**saved["model_config"]))
    task.model = model
    return task, run


def test_sources_end_with_eos_and_decoder_targets_are_the_inputs_shifted_by_one(trained):
    task, _ = trained
    batch = task.collate([0, 1, 2], "test")
    for row in range(3):
        src = batch["src_ids"][row][batch["src_mask"][row].bool()].tolist()
        assert src[-1] == EOS_ID and EOS_ID not in src[:-1]
        tgt_in = batch["tgt_in"][row][batch["tgt_in"][row] != PAD_ID].tolist()
        tgt_out = batch["tgt_out"][row][batch["tgt_out"][row] != PAD_ID].tolist()
        assert tgt_in[0] == BOS_ID and tgt_out[-1] == EOS_ID and tgt_in[1:] == tgt_out[:-1]
        assert task.sp.decode(tgt_out[:-1]) == task.splits["test"]["de"][row]


def test_loss_does_not_depend_on_padding(trained):
    task, _ = trained
    batch = task.collate([0, 1, 2, 3], "test")
    more = {name: torch.nn.functional.pad(t, (0, 5), value=PAD_ID) for name, t in batch.items()}  # 5 more columns
    with torch.no_grad():
        loss, n_tokens = task.loss(task.model.eval(), batch)
        padded_loss, padded_tokens = task.loss(task.model, more)
    assert n_tokens == padded_tokens == int(batch["src_mask"].sum()) + int((batch["tgt_out"] != PAD_ID).sum())
    torch.testing.assert_close(padded_loss, loss, atol=1e-6, rtol=1e-6)


def test_training_learns_the_synthetic_translation(trained):
    task, run = trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dev"]["ppl"] < 1.5, summary["dev"]
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    dev_ppl = [r["dev_ppl"] for r in records if "dev_ppl" in r]
    assert dev_ppl[0] > 2 * dev_ppl[-1]
    src, mask = pad(task.splits["test"]["src"], PAD_ID)
    outputs = greedy(task.model, src, mask, 16)
    exact = sum(task.sp.decode(ids) == de for ids, de in zip(outputs, task.splits["test"]["de"], strict=True))
    assert exact >= 0.9 * len(outputs)


def test_translate_eval_reports_chrf_ppl_and_decode_time(trained, capsys):
    _, run = trained
    training_main(["translate-eval", "--checkpoint", str(run / "best.pt"), "--split", "test", "--threads", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 100 and result["chrf"] > 90 and result["dev_ppl"] < 1.5
    assert result["decode_s"] > 0 and (run / "eval-test-beam1.json").exists()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_batched_decoding_equals_one_at_a_time(trained, beam_size):
    task, _ = trained
    sources = task.splits["test"]["src"][:12]  # 1 to 3 words: rows finish at different steps
    src, mask = pad(sources, PAD_ID)
    search = (lambda s, m: greedy(task.model, s, m, 16)) if beam_size == 1 else (
        lambda s, m: beam_search(task.model, s, m, beam_size, 16))  # fmt: skip
    batched = search(src, mask)
    alone = [search(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in sources]
    assert batched == alone


def test_beam_search_translates_and_respects_max_new_tokens(trained):
    task, _ = trained
    src, mask = pad(task.splits["test"]["src"][:20], PAD_ID)
    outputs = beam_search(task.model, src, mask, 4, 16)
    exact = sum(task.sp.decode(ids) == de for ids, de in zip(outputs, task.splits["test"]["de"][:20], strict=True))
    assert exact >= 18
    assert all(len(ids) <= 2 for ids in beam_search(task.model, src, mask, 4, 2))
    assert all(len(ids) <= 2 for ids in greedy(task.model, src, mask, 2))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    task, run = trained
    bundle = tmp_path_factory.mktemp("bundle") / "translate-tiny"
    config = export_translator(run / "best.pt", run.parent / "data" / "spm.model", bundle, bundle.name,
                               task.splits["test"]["src"][:40])  # fmt: skip
    return task, bundle, config


def test_exported_greedy_is_identical_to_pytorch_and_logits_agree(exported):
    _, bundle, config = exported
    parity = config["parity"]
    assert parity["greedy_identical"] == parity["sentences"] == 40
    assert parity["max_abs_logit_diff_cached_steps"] <= 1e-4 and parity["max_abs_logit_diff_full_prefix"] <= 1e-4
    assert config["task"] == "translate" and config["onnx"] == {"encoder": "encoder.onnx", "decoder": "decoder.onnx"}
    assert (config["k"], config["k_cross"], config["n_max"], config["tgt_n_max"]) == (8, 8, 16, 16)
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    assert set(manifest) == {"config.json", "encoder.onnx", "decoder.onnx", "tokenizer.model", "MODEL_CARD.md"}
    assert all(sha256(bundle / name) == digest for name, digest in manifest.items())
    assert "Parity" in (bundle / "MODEL_CARD.md").read_text()


def test_step_decoder_steps_rows_of_different_lengths_in_one_call_like_pytorch(exported, trained):
    """Row 0 decodes two tokens alone, then rows 1 and 2 join it: each call holds rows at different lengths, the
    cache buffers (and the cross keys, by each row's source length) are bound as both past and present, and every
    row's logits equal PyTorch's for its prefix."""
    task, bundle, config = exported
    model = task.model
    L, H, hd, T = config["n_decoder_layers"], config["n_heads"], config["head_dim"], config["tgt_n_max"]
    encoder, decoder = sessions(bundle)
    assert {i.name for i in decoder.get_inputs()} >= {"past_lengths", "total_length", "cross_lengths"}
    src, mask = pad(task.splits["test"]["src"][:3], PAD_ID)
    cross_names = cache_names("cross", L)
    cross = encoder.run([*cross_names, "cross_mask"], {"input_ids": src.numpy(), "attention_mask": mask.numpy()})
    tgt = torch.tensor([[BOS_ID, 5, 6, 7, 8, 9]] * 3)
    with torch.no_grad():
        expected = model.decode(tgt, model.encode(src, mask))[0].numpy()  # (3, 6, V): every prefix at once
    caches = {name: np.full((3, H, T, hd), np.nan, np.float32) for name in cache_names("past", L)}  # never read
    lengths = np.array([0, 0, 0], np.int32)
    for rows in (1, 1, 3, 3, 3):
        binding = decoder.io_binding()
        tokens = tgt[np.arange(rows), lengths[:rows]].numpy()[:, None]
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(tokens))
        binding.bind_cpu_input("past_lengths", lengths[:rows].copy())
        binding.bind_cpu_input("total_length", np.array([lengths[:rows].max() + 1], np.int32))
        keys_values = {name: array[:rows] for name, array in zip(cross_names, cross[:-1], strict=True)}
        kept = bind_cross(decoder, binding, keys_values, cross[-1][:rows])
        for name, cache in caches.items():
            for role, bind in ((name, binding.bind_input), (name.replace("past", "present"), binding.bind_output)):
                bind(role, "cpu", 0, np.float32, [rows, H, T, hd], cache.ctypes.data)
        logits = np.empty((rows, config["vocab_size"]), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        decoder.run_with_iobinding(binding)
        del kept
        for row in range(rows):
            np.testing.assert_allclose(logits[row], expected[row, lengths[row]], atol=1e-4)
        lengths[:rows] += 1
    assert lengths.tolist() == [5, 3, 3]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_service_runtime_decodes_like_pytorch(exported, beam_size):
    task, bundle, config = exported
    encoder, decoder = sessions(bundle)
    runtime = TranslatorRuntime(encoder, decoder, n_layers=config["n_decoder_layers"], n_heads=config["n_heads"],
                                head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"], bos_id=BOS_ID,
                                eos_id=EOS_ID)  # fmt: skip
    src, mask = pad(task.splits["test"]["src"][:30], PAD_ID)
    served = runtime.run(src.numpy(), mask.numpy(), (beam_size, 16))
    if beam_size == 1:
        assert served == greedy(task.model, src, mask, 16)
    else:
        assert served == beam_search(task.model, src, mask, beam_size, 16)


def test_service_runtime_refuses_an_onnxruntime_that_decodes_the_step_form_wrongly(exported, monkeypatch):
    """1.20 loads the step-form decoder but decodes batches wrongly (service/runtime.py): refuse it by name."""
    _, bundle, config = exported
    encoder, decoder = sessions(bundle)
    monkeypatch.setattr("service.runtime.ort.__version__", "1.20.1")
    with pytest.raises(ValueError, match="needs onnxruntime >= 1.21, this is 1.20.1"):
        TranslatorRuntime(encoder, decoder, n_layers=config["n_decoder_layers"], n_heads=config["n_heads"],
                          head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"], bos_id=BOS_ID,
                          eos_id=EOS_ID)  # fmt: skip


def test_vanilla_transformer_exports_with_the_same_contract(tmp_path):
    bundle, _ = build_tiny_translate_bundle(tmp_path / "translate-transformer", attention="transformer")
    config = json.loads((bundle / "config.json").read_text())
    assert config["attention"] == "transformer" and config["k_cross"] is None
    assert config["parity"]["greedy_identical"] == config["parity"]["sentences"]
    assert config["parity"]["max_abs_logit_diff_cached_steps"] <= 1e-4


def earlier_step_form(decoder: onnx.ModelProto) -> onnx.ModelProto:
    """The step form before the twenty-second session, made from today's: cross-attention as MultiHeadAttention over
    every row's whole cross width with a cross_mask (bool, B x memory) as key padding mask."""
    graph = decoder.graph
    crossed = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.input[3].startswith("cross_")]
    for node in crossed:
        mha = helper.make_node("MultiHeadAttention", [node.input[0], node.input[3], node.input[4], "", "key_padding"],
                               [node.output[0]], domain="com.microsoft", num_heads=node.attribute[0].i)  # fmt: skip
        graph.node.insert(list(graph.node).index(node), mha)
        graph.node.remove(node)
    for node in [n for n in graph.node if "cross_lengths" in n.input]:
        graph.node.remove(node)
    graph.node.insert(0, helper.make_node("Cast", ["cross_mask"], ["key_padding"], to=onnx.TensorProto.INT32))
    for value in [v for v in graph.input if v.name.startswith(("cross_last_", "cross_lengths", "cross_total"))]:
        graph.input.remove(value)
    graph.input.append(helper.make_tensor_value_info("cross_mask", onnx.TensorProto.BOOL, ["batch", "memory"]))
    for value in [v for v in graph.output if v.name.startswith("present_cross_")]:
        graph.output.remove(value)
    onnx.checker.check_model(decoder)
    return decoder


def test_an_earlier_step_form_bundle_is_rebuilt_and_checked_against_itself(tmp_path):
    """`python -m export step-decoder` on a bundle whose decoder is the earlier step form (the committed bundles until
    the twenty-second session): rebuilt from its own weights, greedy output identical to it on sources of many
    lengths (vanilla cross-attention: each row its own cross length), which the service then refuses no more."""
    from export.step_decoder import convert_bundle, decoder_form, step_logits

    bundle, _ = build_tiny_translate_bundle(tmp_path / "translate-transformer", attention="transformer")
    decoder = bundle / "decoder.onnx"
    onnx.save(earlier_step_form(onnx.load(str(decoder))), str(decoder))
    assert decoder_form(decoder) == "earlier step"
    encoder, earlier = sessions(bundle)
    config = json.loads((bundle / "config.json").read_text())
    with pytest.raises(ValueError, match="earlier step form"):
        TranslatorRuntime(encoder, earlier, n_layers=config["n_decoder_layers"], n_heads=config["n_heads"],
                          head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"], bos_id=BOS_ID,
                          eos_id=EOS_ID)  # fmt: skip
    rng = np.random.default_rng(0)
    sources = [[*rng.integers(4, config["vocab_size"], int(n)).tolist(), EOS_ID] for n in rng.integers(1, 15, 40)]
    ids, mask = pad([torch.tensor(source) for source in sources[:8]], PAD_ID)
    before, fed = step_logits(encoder, earlier, config, ids.numpy(), mask.numpy(), steps=6)
    config = convert_bundle(bundle, sources)
    after, _ = step_logits(encoder, sessions(bundle)[1], config, ids.numpy(), mask.numpy(), steps=6, forced=fed)
    np.testing.assert_allclose(after, before, atol=1e-5)  # each row over its own source, as the mask had it
    parity = config["export"]["step_parity"]
    assert decoder_form(decoder) == "step"
    assert parity["reference"] == "the earlier step form"
    assert parity["greedy_identical"] == parity["sentences"] == 40
    assert parity["earlier_step_parity"]["sentences"] > 0  # the chain back to the exported decoder's check
    card = (bundle / "MODEL_CARD.md").read_text()
    assert card.count("## Decoder form") == 1 and "40/40 sources" in card
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    assert manifest["decoder.onnx"] == sha256(decoder)
    with pytest.raises(ValueError, match="already the step form"):
        convert_bundle(bundle, sources)


def test_banned_tokens_are_those_that_would_repeat_an_ngram():
    assert banned_tokens([5, 6, 7, 5, 6], 3) == [7]  # "5 6" was followed by 7 before
    assert banned_tokens([5, 6, 7, 5, 6], 2) == [7]  # 6 was followed by 7 before
    assert banned_tokens([5, 6], 3) == []
    assert banned_tokens([4, 4, 4], 1) == [4, 4, 4]


def test_no_repeat_ngram_and_length_limits_constrain_the_search(trained):
    task, _ = trained
    src, mask = pad(task.splits["test"]["src"][:20], PAD_ID)
    for search in (lambda **kw: greedy(task.model, src, mask, 16, **kw),
                   lambda **kw: beam_search(task.model, src, mask, 3, 16, **kw)):  # fmt: skip
        for ids in search(no_repeat_ngram=1):
            assert len(ids) == len(set(ids))
        limits = [1 + i % 3 for i in range(20)]
        assert all(len(ids) <= limit for ids, limit in zip(search(max_lengths=limits), limits, strict=True))
        assert search(max_lengths=[16] * 20) == search()  # a limit never reached changes nothing
    assert length_limits(mask, 1.5, 2) == [int(1.5 * n + 2) for n in mask.sum(dim=1).tolist()]


def test_a_checkpoint_rebuilt_from_the_bundle_decodes_like_the_original(exported, tmp_path):
    task, bundle, _ = exported
    recover(bundle, tmp_path / "recovered.pt", "unused")
    rebuilt, _ = load_translator(tmp_path / "recovered.pt")
    src, mask = pad(task.splits["test"]["src"][:20], PAD_ID)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(src, mask, src), task.model.eval()(src, mask, src), atol=1e-5, rtol=1e-5)
    assert greedy(rebuilt, src, mask, 16) == greedy(task.model, src, mask, 16)


def test_training_can_start_from_a_checkpoint(trained, tmp_path):
    task, run = trained
    data = run.parent / "data"
    training_main(["translate", "--data", str(data), *TINY_TRANSLATOR, "--max-steps", "2", "--lr", "1e-9",
                   "--warmup-steps", "1", "--max-tokens", "512", "--threads", "1", "--init-from", str(run / "best.pt"),
                   "--save-every", "1", "--keep-checkpoints", "1", "--out", str(tmp_path / "more")])  # fmt: skip
    summary = json.loads((tmp_path / "more" / "summary.json").read_text())
    assert summary["dev"]["ppl"] < 1.5  # it started trained (lr ~0 leaves it there), not from scratch
    assert summary["init_from"]["checkpoint"] == str(run / "best.pt")
    assert [p.name for p in (tmp_path / "more").glob("step-*.pt")] == ["step-2.pt"]


def test_checkpoint_averaging_takes_the_mean_of_the_last_kept_weights(tmp_path):
    for step, value in ((200, 1.0), (400, 2.0), (600, 4.0)):
        torch.save({"model": {"w": torch.full((2,), value)}, "model_config": {"step": step}, "step": step,
                    "extra": {}}, tmp_path / f"step-{step}.pt")  # fmt: skip
    paths = kept_checkpoints(tmp_path, 2)
    assert [p.name for p in paths] == ["step-400.pt", "step-600.pt"]
    averaged = average_checkpoints(paths)
    torch.testing.assert_close(averaged["model"]["w"], torch.full((2,), 3.0))
    assert averaged["model_config"] == {"step": 600} and averaged["extra"]["averaged_steps"] == [400, 600]
