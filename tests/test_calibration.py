"""The batcher's token budget comes from the bundle's measured calibration, and the choice follows the table."""

import json
import shutil

import pytest
from conftest import make_settings, running_service

from export.calibrate import calibrate_bundle, choose_batch_sizes, choose_budget
from service.bundle import BundleError, load_bundle

pytestmark = pytest.mark.anyio


def test_budget_keeps_long_texts_out_of_the_batches_that_slow_them_down():
    # short texts gain from batching up to 32; 512-token texts lose 20 % per text past batch 4
    table = {
        64: {1: 1000, 2: 1050, 4: 1080, 8: 1100, 16: 1100, 32: 1100},
        512: {1: 175, 2: 176, 4: 177, 8: 160, 16: 150, 32: 141},
    }
    budget, worst = choose_budget(table)
    assert budget == 4 * 512  # 64-token texts still batch 32 under it; 512-token ones at most 4
    assert worst == pytest.approx(1.0)
    # one length alone: the largest batch within the noise of its best rate
    assert choose_budget({64: table[64]})[0] == 32 * 64


def test_the_largest_budget_among_those_within_the_noise_of_the_best():
    table = {
        16: {1: 900, 2: 960, 4: 1000, 8: 985, 16: 980, 32: 975},  # flat past 4: noise decides nothing
        128: {1: 300, 2: 300, 4: 300, 8: 250, 16: 240, 32: 200},
    }
    assert choose_budget(table)[0] == 512  # 16-token texts in 32s (0.975), 128-token ones in 4s (1.0)


def test_each_length_batches_up_to_the_largest_size_within_the_allowance_of_its_best():
    table = {
        16: {1: 900, 2: 960, 4: 1000, 8: 985, 16: 955, 32: 940},  # 16 within 5 % of the best (4), 32 not
        64: {1: 500, 2: 520, 4: 560, 8: 530, 16: 520, 32: 500},  # past 4 every size loses over 5 %
        512: {1: 175, 2: 176, 4: 172, 8: 160, 16: 150, 32: 141},  # 4 at 0.977 of the best (2), 8 at 0.909
    }
    assert choose_batch_sizes(table) == {16: 16, 64: 4, 512: 4}


@pytest.fixture
def calibrated_models(models_dir, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(models_dir, root)
    calibrate_bundle(root / "classify-linformer")
    return root


async def test_the_service_batches_within_the_measured_budget(calibrated_models):
    bundle = load_bundle(calibrated_models / "classify-linformer")
    manifest = json.loads((bundle.path / "manifest.json").read_text())
    assert bundle.max_batch_tokens == manifest["batching"]["max_batch_tokens"] > 0
    assert set(manifest["batching"]["texts_per_cpu_second"]["16"]) == {"1", "2", "4", "8", "16", "32"}
    sizes = {int(length): size for length, size in manifest["batching"]["max_batch_size_by_length"].items()}
    assert bundle.max_batch_size_by_length == sizes
    assert set(sizes) == {int(length) for length in manifest["batching"]["texts_per_cpu_second"]}

    settings = make_settings(calibrated_models, translate_model="")
    async with running_service(settings) as client:
        batcher = client._transport.app.state.service.models["classify"].batcher
        assert batcher.max_batch_tokens == bundle.max_batch_tokens
        assert batcher.max_batch_size_by_length == sizes
        assert (await client.post("/classify", json={"text": "the film"})).status_code == 200

    async with running_service(make_settings(calibrated_models, translate_model="", max_batch_tokens=77)) as client:
        batcher = client._transport.app.state.service.models["classify"].batcher
        assert batcher.max_batch_tokens == 77
        assert batcher.max_batch_size_by_length == {}  # an explicit budget alone decides


async def test_a_bundle_without_calibration_keeps_the_old_default(models_dir):
    async with running_service(make_settings(models_dir, translate_model="")) as client:
        batcher = client._transport.app.state.service.models["classify"].batcher
        assert batcher.max_batch_tokens == 16384
        assert batcher.max_batch_size_by_length == {}


async def test_a_bundle_calibrated_before_the_sizes_per_length_keeps_its_budget_alone(calibrated_models):
    manifest_path = calibrated_models / "classify-linformer" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["batching"]["max_batch_size_by_length"]
    manifest_path.write_text(json.dumps(manifest))
    assert load_bundle(calibrated_models / "classify-linformer").max_batch_size_by_length is None
    async with running_service(make_settings(calibrated_models, translate_model="")) as client:
        batcher = client._transport.app.state.service.models["classify"].batcher
        assert batcher.max_batch_tokens == manifest["batching"]["max_batch_tokens"]
        assert batcher.max_batch_size_by_length == {}


def test_reusing_the_recorded_table_adds_the_sizes_without_measuring_again(calibrated_models, monkeypatch):
    bundle = calibrated_models / "classify-linformer"
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["batching"]["max_batch_size_by_length"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))

    def no_measuring(*args, **kwargs):
        raise AssertionError("--reuse-table must not measure")

    monkeypatch.setattr("export.calibrate.measure", no_measuring)
    batching = calibrate_bundle(bundle, reuse_table=True)
    assert batching["texts_per_cpu_second"] == manifest["batching"]["texts_per_cpu_second"]
    assert batching["measured_with"] == manifest["batching"]["measured_with"]
    assert batching["max_batch_tokens"] == manifest["batching"]["max_batch_tokens"]
    table = {int(n): {int(b): r for b, r in rates.items()} for n, rates in batching["texts_per_cpu_second"].items()}
    assert batching["max_batch_size_by_length"] == {str(n): size for n, size in choose_batch_sizes(table).items()}
    sizes = {int(n): size for n, size in batching["max_batch_size_by_length"].items()}
    assert load_bundle(bundle).max_batch_size_by_length == sizes


def test_a_mangled_budget_refuses_the_bundle(calibrated_models):
    manifest_path = calibrated_models / "classify-linformer" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["batching"]["max_batch_tokens"] = "lots"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="max_batch_tokens"):
        load_bundle(calibrated_models / "classify-linformer")


@pytest.mark.parametrize("sizes", ["lots", {"64": 0}, {"64": "4"}, {}, {"sixty": 4}])
def test_mangled_sizes_per_length_refuse_the_bundle(calibrated_models, sizes):
    manifest_path = calibrated_models / "classify-linformer" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["batching"]["max_batch_size_by_length"] = sizes
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="max_batch_size_by_length"):
        load_bundle(calibrated_models / "classify-linformer")
