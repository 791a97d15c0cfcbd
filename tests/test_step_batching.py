"""Step-level (continuous) batching of /translate (LINFORMER_TRANSLATE_SCHEDULING=step) on the committed bundles:
sources join the decode loop between steps and leave as soon as they end, and every answer is the one the
source gets when decoded alone."""

import asyncio
import json
import re
import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import make_settings, running_service

from service.app import make_runtime
from service.batcher import WIDE_SHARE, BatchFailed, DeadlineExceeded, ShuttingDown, StepBatcher
from service.bundle import load_bundle
from service.runtime import LiveDecode, width_class
from service.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
TESTS = Path(__file__).resolve().parent
# held-out EN-DE test sources of 16, 32, 64 and 128 tokens (4 each), committed for the load tests
LOAD_TEXTS = json.loads((REPO / "loadtest" / "data" / "translate.json").read_text())["texts"]
SHORT_TEXTS = ["Save the file.", "Click OK.", "The chart is updated automatically when you change the data."]
MIXED = [LOAD_TEXTS["128"][0], *SHORT_TEXTS, LOAD_TEXTS["64"][0], LOAD_TEXTS["16"][0], LOAD_TEXTS["128"][1],
         LOAD_TEXTS["32"][0], LOAD_TEXTS["64"][1], LOAD_TEXTS["16"][1], LOAD_TEXTS["32"][1]]  # fmt: skip


class RecordingLive(LiveDecode):
    """LiveDecode that notes, before each trip of steps, the most distinct target lengths in one of its decoder
    calls and the sources live (and may slow each step down)."""

    def __init__(self, runtime, width_classes: bool = False, step_delay_s: float = 0.0):
        super().__init__(runtime, width_classes)
        self.step_delay_s = step_delay_s
        self.steps: list[tuple[int, set]] = []  # (distinct lengths, keys) before each step
        self.most_cohorts = 0  # the most cohorts (decoder calls per step) live at once

    def step(self, steps=1, widths=None, budget_s=None):
        distinct = [len(set(c.buffers.lengths[: c.rows].tolist())) for c in self.cohorts.values() if c.buffers]
        self.most_cohorts = max(self.most_cohorts, len(self.cohorts))
        self.steps.append((max(distinct, default=0), {search.key for search in self.searches}))
        time.sleep(self.step_delay_s * steps)
        return super().step(steps, widths, budget_s)


class Recorded:
    """wrap_runtime: the translator, with its step-level decoding recorded."""

    def __init__(self, runtime, step_delay_s: float = 0.0):
        self.runtime, self.step_delay_s = runtime, step_delay_s
        self.lives: list[RecordingLive] = []

    def live(self, width_classes: bool = True) -> RecordingLive:
        self.lives.append(RecordingLive(self.runtime, width_classes, self.step_delay_s))
        return self.lives[-1]

    def run(self, *args):
        return self.runtime.run(*args)


def recorded(wrappers: list, step_delay_s: float = 0.0):
    """wrap_runtime that keeps its Recorded wrapper in `wrappers`."""

    def wrap(runtime) -> Recorded:
        wrappers.append(Recorded(runtime, step_delay_s))
        return wrappers[-1]

    return wrap


def step_settings(model: str, **overrides):
    return make_settings(MODELS, classify_model="", translate_model=model, translate_scheduling="step", **overrides)


def translator(model: str):
    bundle = load_bundle(MODELS / model)
    return bundle, Tokenizer.from_bundle(bundle), make_runtime(bundle, ["CPUExecutionProvider"], step_settings(model))


def source_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_all([text], truncate=True)[0].ids


def alone(runtime, tokenizer, text: str, beam_size: int = 1, max_new_tokens: int = 256) -> list[int]:
    """The request-level runtime on this one source: what decoding it alone gives."""
    ids = source_ids(tokenizer, text)
    return runtime.run(np.array([ids]), np.ones((1, len(ids)), dtype=np.int64), (beam_size, max_new_tokens))[0]


async def staggered(client, payloads: list[dict], gap_s: float) -> list[tuple[float, httpx.Response]]:
    """POST each payload gap_s after the previous one; (time answered, response) in sending order. Each text is
    decoded whole (split_sentences false), as `alone` decodes it: the load texts run several sentences together."""

    async def send(i: int, payload: dict):
        await asyncio.sleep(i * gap_s)
        response = await client.post("/translate", json={**payload, "split_sentences": False})
        return time.monotonic(), response

    return await asyncio.gather(*(send(i, p) for i, p in enumerate(payloads)))


@pytest.mark.parametrize("model", ["translate-linformer", "translate-transformer"])
async def test_greedy_under_staggered_concurrent_arrivals_equals_decoding_each_alone(model):
    _, tokenizer, runtime = translator(model)
    payloads = [{"text": text, "max_new_tokens": 40 + 7 * i} for i, text in enumerate(MIXED)]
    expected = [alone(runtime, tokenizer, p["text"], 1, p["max_new_tokens"]) for p in payloads]
    wrappers = []
    async with running_service(step_settings(model), wrap_runtime=recorded(wrappers)) as client:
        answered = await staggered(client, payloads, gap_s=0.004)
    for (_, response), tokens in zip(answered, expected, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["translations"][0] == {"text": tokenizer.decode(tokens), "tokens": len(tokens)}
    live = wrappers[0].lives[0]
    assert max(lengths for lengths, _ in live.steps) >= 2, "sources should have joined while others were decoding"
    # the throughput policy: sources of every width (128 tokens and a few words here) step in one decoder call
    assert not live.width_classes and live.most_cohorts == 1

    # the first request (128 tokens, a long output) was still decoding when later, shorter ones were answered
    first_done = answered[0][0]
    assert any(done < first_done for done, _ in answered[1:])


async def test_beam_search_and_greedy_sharing_steps_equal_each_decoded_alone():
    model = "translate-linformer"
    _, tokenizer, runtime = translator(model)
    texts = [LOAD_TEXTS["64"][2], SHORT_TEXTS[0], LOAD_TEXTS["32"][2], SHORT_TEXTS[2], LOAD_TEXTS["16"][2]]
    payloads = [{"text": text, "beam_size": beam} for text, beam in zip(texts, (4, 1, 3, 4, 2), strict=True)]
    expected = [alone(runtime, tokenizer, p["text"], p["beam_size"]) for p in payloads]
    wrappers = []
    async with running_service(step_settings(model), wrap_runtime=recorded(wrappers)) as client:
        answered = await staggered(client, payloads, gap_s=0.003)
    assert [r.json()["translations"][0]["text"] for _, r in answered] == [tokenizer.decode(t) for t in expected]
    assert max(lengths for lengths, _ in wrappers[0].lives[0].steps) >= 2


@pytest.mark.parametrize("beam_size", [1, 3])
def test_rows_of_different_lengths_share_one_decoder_call_per_width_class_and_decode_as_alone(beam_size):
    from service.batcher import pad

    _, tokenizer, runtime = translator("translate-linformer")
    texts = [LOAD_TEXTS["128"][0], LOAD_TEXTS["128"][1], SHORT_TEXTS[2]]
    ids = [source_ids(tokenizer, t) for t in texts]
    wide, narrow = width_class(len(ids[0])), width_class(len(ids[2]))
    assert width_class(len(ids[1])) == wide != narrow
    live = runtime.live()
    calls = []
    run_with_iobinding = runtime.decoder.run_with_iobinding
    live.admit(*pad(ids[:1], 0), [("old", (beam_size, 256))])
    for _ in range(3):
        live.step()
    live.admit(*pad(ids[1:], 0), [("new", (beam_size, 256)), ("newer", (beam_size, 256))])
    # old and new: one cohort, rows at target lengths 3 and 0; newer, a short source, decodes in its own
    cohort = live.cohorts[wide]
    assert sorted(set(cohort.buffers.lengths[: cohort.rows].tolist())) == [0, 3] and cohort.rows == 2 * beam_size
    assert live.cohorts[narrow].rows == beam_size and live.cohorts[narrow].buffers.memory < cohort.buffers.memory
    outputs: dict = {}
    try:
        runtime.decoder.run_with_iobinding = lambda binding: calls.append(binding) or run_with_iobinding(binding)
        finished, failed = live.step()  # one call per width class
    finally:
        del runtime.decoder.run_with_iobinding
    assert len(calls) == 2 and not failed
    outputs.update(finished)
    while live.rows:
        finished, failed = live.step()
        assert not failed
        outputs.update(finished)
    assert outputs == {key: alone(runtime, tokenizer, text, beam_size)
                       for key, text in zip(("old", "new", "newer"), texts, strict=True)}  # fmt: skip
    assert not live.cohorts  # nothing held once nobody is live


@pytest.mark.parametrize("beam_size", [1, 3])
def test_without_width_classes_every_live_row_steps_in_one_decoder_call_and_decodes_as_alone(beam_size):
    """Step-level batching's throughput policy: a long source and two short ones (two width classes apart) that join
    three steps later share one cohort and one decoder call per step, and each decodes as it would alone."""
    from service.batcher import pad

    _, tokenizer, runtime = translator("translate-linformer")
    texts = [LOAD_TEXTS["128"][0], SHORT_TEXTS[2], SHORT_TEXTS[0]]
    ids = [source_ids(tokenizer, t) for t in texts]
    assert width_class(len(ids[0])) != width_class(len(ids[1])) == width_class(len(ids[2]))
    live = runtime.live(width_classes=False)
    live.admit(*pad(ids[:1], 0), [("long", (beam_size, 256))])
    for _ in range(3):
        live.step()
    live.admit(*pad(ids[1:], 0), [("short", (beam_size, 256)), ("shorter", (beam_size, 256))])
    assert list(live.cohorts) == [0] and live.cohorts[0].rows == 3 * beam_size
    calls, steps, outputs = [], 0, {}
    run_with_iobinding = runtime.decoder.run_with_iobinding
    try:
        runtime.decoder.run_with_iobinding = lambda binding: calls.append(binding) or run_with_iobinding(binding)
        while live.rows:
            finished, failed = live.step()
            steps += 1
            assert not failed
            outputs.update(finished)
    finally:
        del runtime.decoder.run_with_iobinding
    assert len(calls) == steps
    assert outputs == {key: alone(runtime, tokenizer, text, beam_size)
                       for key, text in zip(("long", "short", "shorter"), texts, strict=True)}  # fmt: skip


def test_the_runtime_refuses_a_cross_mask_that_is_not_a_prefix_and_the_earlier_step_form():
    """The decoder reads each row's source as its first cross_lengths positions: a left-padded source would be read
    wrongly, so it is refused; so is a decoder of the step form before (cross-attention over a cross_mask)."""
    from types import SimpleNamespace

    from service.runtime import TranslatorRuntime

    _, tokenizer, runtime = translator("translate-linformer")
    ids = source_ids(tokenizer, SHORT_TEXTS[0])
    input_ids = np.array([[0, 0, *ids]], np.int64)  # padded on the left
    with pytest.raises(ValueError, match="not a prefix"):
        runtime.live().admit(input_ids, (input_ids != 0).astype(np.int64), [("left", (1, 16))])
    earlier = SimpleNamespace(get_inputs=lambda: [SimpleNamespace(name=n) for n in ("past_lengths", "cross_mask")])
    with pytest.raises(ValueError, match="earlier step form.*python -m export step-decoder"):
        TranslatorRuntime(runtime.encoder, earlier, n_layers=3, n_heads=4, head_dim=32, tgt_n_max=256, bos_id=2,
                          eos_id=3)  # fmt: skip


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_decode_takes_the_small_buffers_the_last_one_left_and_decodes_as_on_new_ones(beam_size):
    """Buffers (and their IO bindings) outlive their last source when small, for the next decode of about the same
    width: what it decodes there equals what it decodes on new buffers, whatever the last source left in them."""
    from service.batcher import pad
    from service.runtime import SPARE_DECODE_BYTES

    _, tokenizer, runtime = translator("translate-linformer")
    first, second = LOAD_TEXTS["32"][0], LOAD_TEXTS["32"][1]
    runtime._spare = None
    on_new = alone(runtime, tokenizer, second, beam_size)
    alone(runtime, tokenizer, first, beam_size)
    kept = runtime._spare
    assert kept is not None and kept.nbytes <= SPARE_DECODE_BYTES and kept.rows == 0
    live = runtime.live()
    live.admit(*pad([source_ids(tokenizer, second)], 0), [("again", (beam_size, 256))])
    assert next(iter(live.cohorts.values())).buffers is kept and runtime._spare is None
    outputs: dict = {}
    while live.rows:
        finished, failed = live.step()
        assert not failed
        outputs.update(finished)
    assert outputs == {"again": on_new} and runtime._spare is kept
    # a source that would pay for twice its cross width does not take them
    assert runtime.take_spare(1, kept.memory // 2 - 16) is None and runtime._spare is kept


def test_a_step_can_serve_chosen_width_classes_within_a_time_budget():
    from service.batcher import pad

    _, tokenizer, runtime = translator("translate-linformer")
    texts = [LOAD_TEXTS["128"][0], SHORT_TEXTS[2]]
    ids = [source_ids(tokenizer, t) for t in texts]
    wide, narrow = (width_class(len(x)) for x in ids)
    live = runtime.live()
    live.admit(*pad(ids, 0), [("long", (1, 256)), ("short", (1, 256))])
    assert live.widths == [narrow, wide]

    def lengths():
        return {width: int(c.buffers.lengths[0]) for width, c in live.cohorts.items()}

    live.step(3, widths=[narrow])  # the wide cohort waits as it is
    assert lengths() == {narrow: 3, wide: 0}
    live.step(4, budget_s=0.0)  # out of time after each cohort's first step
    assert lengths() == {narrow: 4, wide: 1}
    outputs: dict = {}
    while live.rows:  # sources that waited decode as they would alone
        finished, failed = live.step(2, widths=live.widths[-1:])
        assert not failed
        outputs.update(finished)
    assert outputs == {"long": alone(runtime, tokenizer, texts[0]), "short": alone(runtime, tokenizer, texts[1])}


class SimulatedLive:
    """A LiveDecoding without a model: a source of options (1, n) needs n steps and is answered with its ids; a
    decoder call takes `call_s` per width class (64 or 256 here). Notes what each trip stepped."""

    call_s = {64: 0.0005, 256: 0.002}

    def __init__(self):
        self.sources: dict = {}  # key -> [width, steps left, ids]
        self.trips: list[tuple[float, dict[int, float], bool]] = []  # (end, seconds per class, both classes live)

    @property
    def rows(self):
        return len(self.sources)

    @property
    def cache_tokens(self):
        return sum(len(ids) for _, _, ids in self.sources.values())

    @property
    def widths(self):
        return sorted({width for width, _, _ in self.sources.values()})

    @staticmethod
    def rows_for(options):
        return 1

    @staticmethod
    def width_class(source_length):
        return width_class(source_length)

    def admit(self, input_ids, attention_mask, sources):
        for row, (key, (_beam, steps)) in enumerate(sources):
            ids = input_ids[row][attention_mask[row] == 1].tolist()
            self.sources[key] = [self.width_class(len(ids)), steps, ids]

    def step(self, steps=1, widths=None, budget_s=None):
        both_live, spent, finished = len(self.widths) > 1, {}, {}
        for width in self.widths:
            if widths is not None and width not in widths:
                continue
            for _ in range(steps):
                time.sleep(self.call_s[width])
                spent[width] = spent.get(width, 0.0) + self.call_s[width]
                for key, source in list(self.sources.items()):
                    if source[0] == width:
                        source[1] -= 1
                        if source[1] == 0:
                            finished[key] = source[2]
                            del self.sources[key]
                if budget_s is not None and sum(spent.values()) >= budget_s:
                    break
        self.trips.append((time.monotonic(), spent, both_live))
        return finished, {}

    def drop(self, keys):
        for key in keys:
            self.sources.pop(key, None)


async def test_short_sources_go_first_and_long_ones_keep_a_bounded_share_of_the_steps():
    """A stream of short sources does not wait for the long ones' steps at every trip, and the long ones, though
    short work never runs out, get about WIDE_SHARE of the decoding time and end (the policy alone, on a
    simulated runtime; the model's own tests are around this one)."""
    live = SimulatedLive()
    batcher = make_step_batcher(live, max_batch_size=16, short_first=True)
    batcher.start()
    long_ids = [7] * 200  # width class 256
    long_sources = [asyncio.create_task(batcher.submit([long_ids], timeout_s=60, options=(1, 1000)))
                    for _ in range(2)]  # fmt: skip
    seen = []  # per short source: decoding time of the (narrow, wide) classes in the trips while it was live

    async def short_stream(seed: int) -> None:
        for i in range(25):
            ids = [seed, i] + [5] * (6 + i % 8)  # width class 64
            started = time.monotonic()
            assert await batcher.submit([ids], timeout_s=60, options=(1, len(ids))) == [ids]
            trips = [spent for end, spent, _ in live.trips if end >= started]
            seen.append(tuple(sum(spent.get(width, 0.0) for spent in trips) for width in (64, 256)))

    await asyncio.gather(*(short_stream(seed) for seed in range(3)))
    assert not any(task.done() for task in long_sources), "1000 steps each: they cannot have ended yet"
    contended = [spent for _, spent, both_live in live.trips if both_live]
    assert [out[0] for out in await asyncio.gather(*long_sources)] == [long_ids] * 2  # not starved
    await batcher.close()
    # while a short source was live, the wide class decoded for less time than the short ones (4 times as long
    # when every trip stepped every class); about WIDE_SHARE / (1 - WIDE_SHARE) of it, plus the trip it fell on
    narrow_seen, wide_seen = (sum(times) for times in zip(*seen, strict=True))
    assert wide_seen < narrow_seen, seen
    wide_s = sum(spent.get(256, 0.0) for spent in contended)
    share = wide_s / sum(sum(spent.values()) for spent in contended)
    assert WIDE_SHARE / 2 <= share <= 2 * WIDE_SHARE, share


async def test_by_default_every_trip_steps_every_live_width_class():
    """The throughput policy (short_first off): a short source shares every trip with the long ones, which are
    not held back while short work keeps arriving."""
    live = SimulatedLive()
    batcher = make_step_batcher(live, max_batch_size=16)
    assert not batcher.short_first
    batcher.start()
    long_ids = [7] * 200  # width class 256
    long_source = asyncio.create_task(batcher.submit([long_ids], timeout_s=60, options=(1, 30)))
    for i in range(5):
        ids = [i] + [5] * 10  # width class 64
        assert await batcher.submit([ids], timeout_s=60, options=(1, 40)) == [ids]
    assert (await long_source) == [long_ids]
    await batcher.close()
    contended = [spent for _, spent, both_live in live.trips if both_live]
    assert contended and all(spent.get(64, 0) > 0 and spent.get(256, 0) > 0 for spent in contended), contended


async def test_a_short_source_arriving_while_long_ones_decode_is_answered_first_and_as_alone():
    _, tokenizer, runtime = translator("translate-transformer")
    long_texts, short_text = [LOAD_TEXTS["128"][0], LOAD_TEXTS["128"][1]], LOAD_TEXTS["32"][2]
    ids = [source_ids(tokenizer, t) for t in (*long_texts, short_text)]
    live = RecordingLive(runtime, width_classes=True, step_delay_s=0.001)
    batcher = make_step_batcher(live, short_first=True)
    batcher.start()
    done: dict[str, float] = {}

    async def translate(name: str, source: list[int]) -> list[int]:
        out = await batcher.submit([source], timeout_s=60, options=(1, 256))
        done[name] = time.monotonic()
        return out[0]

    longs = [asyncio.create_task(translate(f"long{i}", x)) for i, x in enumerate(ids[:2])]
    await asyncio.sleep(0.03)
    assert batcher.live_depth == 2
    short = await translate("short", ids[2])
    outputs = [await task for task in longs]
    await batcher.close()
    assert short == alone(runtime, tokenizer, short_text)
    assert outputs == [alone(runtime, tokenizer, t) for t in long_texts]
    assert done["short"] < min(done["long0"], done["long1"])


def make_step_batcher(live, **overrides) -> StepBatcher:
    config = {"name": "t", "pad_id": 0, "max_batch_size": 8, "max_batch_tokens": 16384, "max_wait_s": 0.0,
              "max_queue": 65536}  # fmt: skip
    return StepBatcher(live, **{**config, **overrides})


async def test_a_source_whose_client_goes_or_whose_deadline_passes_leaves_without_disturbing_the_others():
    _, tokenizer, runtime = translator("translate-linformer")
    texts = [LOAD_TEXTS["64"][3], LOAD_TEXTS["32"][3], LOAD_TEXTS["128"][2]]
    ids = [source_ids(tokenizer, t) for t in texts]
    expected = alone(runtime, tokenizer, texts[0])
    live = RecordingLive(runtime, step_delay_s=0.004)
    batcher = make_step_batcher(live)
    batcher.start()
    kept = asyncio.create_task(batcher.submit([ids[0]], timeout_s=30, options=(1, 256)))
    await asyncio.sleep(0.02)
    late = asyncio.create_task(batcher.submit([ids[1]], timeout_s=0.08, options=(1, 256)))
    gone = asyncio.create_task(batcher.submit([ids[2]], timeout_s=30, options=(1, 256)))
    await asyncio.sleep(0.05)
    assert batcher.live_depth == 3  # all three are decoding
    gone.cancel()  # what the route does when the client disconnects
    with pytest.raises(DeadlineExceeded):
        await late
    assert await kept == [expected]
    await batcher.close()
    live_sets = [keys for _, keys in live.steps]
    last_together = max(i for i, keys in enumerate(live_sets) if len(keys) == 3)
    first_key = next(iter(live_sets[0]))
    assert all(first_key in keys for keys in live_sets)  # the kept source decoded at every step
    assert live_sets[-1] == {first_key} and last_together < len(live_sets) - 1  # the others left, it went on
    assert live.rows == 0


class FailingDecoder:
    """The decoder session, whose calls raise while `failing` is set (a simulated ONNX Runtime failure)."""

    def __init__(self, session):
        self.session, self.failing = session, False

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding):
        if self.failing:
            raise RuntimeError("simulated ONNX Runtime failure")
        return self.session.run_with_iobinding(binding)


async def test_a_runtime_failure_fails_only_the_sources_it_hit():
    _, tokenizer, runtime = translator("translate-linformer")
    healthy, later = LOAD_TEXTS["64"][0], LOAD_TEXTS["32"][0]
    ids = [source_ids(tokenizer, t) for t in (healthy, later)]
    decoder = runtime.decoder = FailingDecoder(runtime.decoder)
    live = RecordingLive(runtime, step_delay_s=0.002)
    batcher = make_step_batcher(live)
    batcher.start()
    # a decoder call fails the sources in it (every live one: they share the call), not the queued or later ones
    first = asyncio.create_task(batcher.submit([ids[0]], timeout_s=30, options=(1, 256)))
    await asyncio.sleep(0.02)
    decoder.failing = True
    with pytest.raises(BatchFailed):
        await first
    decoder.failing = False
    assert live.rows == 0
    assert await batcher.submit([ids[1]], timeout_s=30, options=(1, 256)) == [alone(runtime, tokenizer, later)]
    # an encoder failure fails the sources being admitted, and the loop serves the next ones
    encode = runtime.encode
    runtime.encode = lambda *args: (_ for _ in ()).throw(RuntimeError("simulated encoder failure"))
    with pytest.raises(BatchFailed):
        await batcher.submit([ids[1]], timeout_s=30, options=(1, 256))
    runtime.encode = encode
    assert await batcher.submit([ids[1]], timeout_s=30, options=(1, 256)) == [alone(runtime, tokenizer, later)]
    assert await batcher.submit([ids[0]], timeout_s=30, options=(1, 256)) == [alone(runtime, tokenizer, healthy)]
    await batcher.close()


async def test_a_full_queue_is_429_with_retry_after_under_step_scheduling():
    settings = step_settings("translate-linformer", max_batch_size=1, max_queued_decode_tokens=200,
                             max_decode_tokens_per_request=100)  # fmt: skip
    async with running_service(settings, wrap_runtime=recorded([], step_delay_s=0.01)) as client:
        # costs 100 of the queue's 200 (one row: the text whole)
        payload = {"text": LOAD_TEXTS["32"][0], "max_new_tokens": 100, "split_sentences": False}
        responses = await asyncio.gather(*(client.post("/translate", json=payload) for _ in range(6)))
        statuses = sorted(r.status_code for r in responses)
        # one decoding (or about to) and two queued fit; the rest are refused at once
        assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) == {200, 429}, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "overloaded" and int(refused.headers["retry-after"]) >= 1
        assert (await client.post("/translate", json=payload)).status_code == 200  # the backlog cleared


async def test_live_sources_stay_within_the_text_and_cache_budgets():
    _, tokenizer, runtime = translator("translate-linformer")
    ids = [source_ids(tokenizer, t) for t in MIXED]
    live = RecordingLive(runtime)
    budget = 3 * 140  # cache positions: about three sources of 128 tokens, or many short ones
    batcher = make_step_batcher(live, max_batch_size=4, max_batch_tokens=budget)
    admitted_at: list[tuple[int, int]] = []  # (live cache positions, live texts) right after each admission
    admit = live.admit

    def recording_admit(*args):
        admit(*args)
        admitted_at.append((live.cache_tokens, len(live.searches)))

    live.admit = recording_admit
    batcher.start()
    outputs = await asyncio.gather(*(batcher.submit([x], timeout_s=60, options=(1, 64)) for x in ids))
    await batcher.close()
    assert [out[0] for out in outputs] == [alone(runtime, tokenizer, t, 1, 64) for t in MIXED]
    assert all(texts <= 4 for _, texts in admitted_at)
    # a cohort joins live sources only while the cache stays within budget (one source alone may exceed it)
    assert all(tokens <= budget or texts == 1 for tokens, texts in admitted_at)
    assert len(admitted_at) > 1


async def test_close_finishes_live_sources_and_refuses_new_ones():
    _, tokenizer, runtime = translator("translate-linformer")
    texts = [LOAD_TEXTS["64"][1], LOAD_TEXTS["16"][0]]
    live = RecordingLive(runtime, step_delay_s=0.003)
    batcher = make_step_batcher(live)
    batcher.start()
    ids = [source_ids(tokenizer, t) for t in texts]
    tasks = [asyncio.create_task(batcher.submit([x], timeout_s=30, options=(1, 256))) for x in ids]
    await asyncio.sleep(0.03)
    assert batcher.live_depth == 2
    closing = asyncio.create_task(batcher.close())
    await asyncio.sleep(0)
    with pytest.raises(ShuttingDown):
        await batcher.submit([[5, 3]], timeout_s=30, options=(1, 256))
    await closing
    assert [(await task)[0] for task in tasks] == [alone(runtime, tokenizer, t) for t in texts]


def test_sigterm_finishes_the_sources_being_decoded_then_exits_zero():
    from test_service_process import free_port, start, stop

    port = free_port()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from test_step_batching import Recorded, step_settings
        from service.__main__ import serve
        from service.app import create_app
        settings = step_settings("translate-linformer", port={port}, log_level="info", drain_s=0)
        serve(create_app(settings, wrap_runtime=lambda rt: Recorded(rt, step_delay_s=0.02)), settings)
    """)
    proc = start(["-c", script], port)
    while httpx.get(f"http://127.0.0.1:{port}/readyz").status_code != 200:
        time.sleep(0.1)
    texts = [LOAD_TEXTS["64"][0], LOAD_TEXTS["32"][1], SHORT_TEXTS[2]]
    results: dict[int, object] = {}

    def post(i: int) -> None:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/translate", json={"text": texts[i], "split_sentences": False},
                           timeout=30)  # fmt: skip
            results[i] = r.json()["translations"][0]["text"] if r.status_code == 200 else r.status_code
        except httpx.HTTPError as e:
            results[i] = repr(e)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    time.sleep(0.4)  # 20 ms a step: all three are mid-translation
    code, out = stop(proc, timeout_s=30)
    for thread in threads:
        thread.join()
    _, tokenizer, runtime = translator("translate-linformer")
    assert results == {i: tokenizer.decode(alone(runtime, tokenizer, t)) for i, t in enumerate(texts)}, out
    assert code == 0 and "batchers drained" in out, out


def test_the_scheduling_setting_reads_step_or_request_from_the_environment(monkeypatch):
    from service.config import Settings

    monkeypatch.delenv("LINFORMER_TRANSLATE_SCHEDULING", raising=False)
    assert Settings(_env_file=None).translate_scheduling == "step"  # the default since the twenty-first session
    monkeypatch.setenv("LINFORMER_TRANSLATE_SCHEDULING", "request")
    assert Settings(_env_file=None).translate_scheduling == "request"
    assert not Settings(_env_file=None).translate_step_short_first
    monkeypatch.setenv("LINFORMER_TRANSLATE_STEP_SHORT_FIRST", "true")
    assert Settings(_env_file=None).translate_step_short_first
    monkeypatch.setenv("LINFORMER_TRANSLATE_SCHEDULING", "continuous")
    with pytest.raises(ValueError):
        Settings(_env_file=None)


@pytest.fixture(scope="module")
def tiny_translate(tmp_path_factory):
    from conftest import build_tiny_translate_bundle

    root = tmp_path_factory.mktemp("tiny-step")
    bundle, checkpoint = build_tiny_translate_bundle(root / "translate-linformer")
    return root, bundle, checkpoint


@pytest.mark.parametrize("beam_size", [1, 3])
async def test_on_a_bundle_with_compressed_cross_attention_answers_equal_pytorch_decoding(tiny_translate, beam_size):
    """The tiny bundle's Linformer cross-attention (k_cross rows, their own mask) under staggered arrivals."""
    from test_service_translate import TEXTS, torch_translations

    root, bundle, checkpoint = tiny_translate
    settings = make_settings(root, classify_model="", translate_scheduling="step")
    async with running_service(settings) as client:
        answered = await staggered(client, [{"text": t, "beam_size": beam_size} for t in TEXTS * 2], gap_s=0.002)
    expected = torch_translations(checkpoint, bundle, TEXTS * 2, beam_size)
    assert [r.json()["translations"][0] for _, r in answered] == expected


@pytest.mark.parametrize("cut_in_ratio", [4, 0])
async def test_under_request_scheduling_short_requests_cut_into_a_long_batch_and_decode_as_alone(cut_in_ratio):
    model = "translate-linformer"
    _, tokenizer, runtime = translator(model)
    shorts = [{"max_new_tokens": 12}, {"beam_size": 2}, {}]  # a cut-in may hold short requests of any options
    payloads = [{"text": LOAD_TEXTS["128"][0]}, *({"text": t, **o} for t, o in zip(SHORT_TEXTS, shorts, strict=True))]
    expected = [alone(runtime, tokenizer, p["text"], p.get("beam_size", 1), p.get("max_new_tokens", 256))
                for p in payloads]  # fmt: skip
    settings = make_settings(MODELS, classify_model="", translate_model=model, translate_scheduling="request",
                             translate_cut_in_ratio=cut_in_ratio)  # fmt: skip
    async with running_service(settings) as client:
        answered = await staggered(client, payloads, gap_s=0.01)
        metrics = (await client.get("/metrics")).text
    for (_, response), tokens in zip(answered, expected, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["translations"][0] == {"text": tokenizer.decode(tokens), "tokens": len(tokens)}
    cut_ins = re.search(r'^linformer_cut_in_batches_total\{model="translate-linformer"\} (\S+)$', metrics, re.M)
    assert (cut_ins is not None and float(cut_ins[1]) > 0) == bool(cut_in_ratio)  # counted in /metrics
    long_done = answered[0][0]
    shorts_first = sum(done < long_done for done, _ in answered[1:])
    # with cut-ins the short requests (under a quarter of the long source) run between its steps; without, after it
    assert shorts_first == (len(SHORT_TEXTS) if cut_in_ratio else 0)


def test_a_request_level_batch_with_options_per_row_decodes_each_row_as_alone():
    from service.batcher import pad

    bundle, tokenizer, runtime = translator("translate-linformer")
    options = [(1, 12), (2, 256), (3, 40)]  # what a cut-in of short requests with their own options gets
    input_ids, attention_mask = pad([source_ids(tokenizer, text) for text in SHORT_TEXTS], bundle.pad_id)
    together = runtime.run(input_ids, attention_mask, options)
    assert together == [alone(runtime, tokenizer, t, *o) for t, o in zip(SHORT_TEXTS, options, strict=True)]
