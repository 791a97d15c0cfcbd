"""What the service does off the happy path: garbage input, one error shape, readiness, a failing batch,
per-request budgets, admission control and a batch nobody waits for. In-process, on the tiny real bundles."""

import asyncio
import json
import time

import httpx
import pytest
from conftest import SlowRuntime, make_settings, running_service

from service.errors import ServiceError

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}


@pytest.fixture
async def client(models_dir):
    settings = make_settings(models_dir, translate_model="", max_texts_per_request=8, max_body_bytes=64 * 1024)
    async with running_service(settings) as c:
        yield c


def assert_error_shape(r, status: int, code: str | None = None) -> dict:
    """The one error shape: {"error": {"code", "message", "request_id"}}, the id the same as the header's."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["request_id"] == r.headers["x-request-id"]
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- every bad input gets a clear 4xx, never a 500 ----

BAD_BODIES = {
    "lone surrogate": b'{"text": "bad \\ud800 film"}',
    "lone low surrogate in a list": b'{"texts": ["fine", "\\udfff"]}',
    "NaN text": b'{"text": NaN}',
    "Infinity flag": b'{"text": "ok", "truncate": Infinity}',
    "-Infinity in a list": b'{"texts": [-Infinity]}',
    "invalid UTF-8": b'{"text": "caf\xc3\x28 \xff"}',
    "1k-deep nesting": b'{"text": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    "30k-deep nesting": b"[" * 30_000 + b"]" * 30_000,
    "5,000-digit integer": b'{"text": ' + b"9" * 5000 + b"}",
    "5,000-digit float": b'{"text": "ok", "truncate": 1' + b"0" * 5000 + b".5}",
    "zero-width and BOM only": json.dumps({"text": "\u200b\u200b\ufeff"}).encode(),
    "bidi marks and NBSP only": json.dumps({"texts": ["ok", "\u200e\u00a0\u2060"]}).encode(),
    "control characters only": json.dumps({"text": "\x00\x01\t\x7f"}).encode(),
    "empty body": b"",
    "not JSON": b"text=the film",
    "JSON null": b"null",
    "a bare string": b'"the film"',
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_input_is_a_422_in_the_error_shape(client, body):
    r = await client.post("/classify", content=body, headers=JSON)
    error = assert_error_shape(r, 422, "invalid_request")
    assert "Internal" not in error["message"]


async def test_each_validation_problem_is_listed_with_where_it_is(client):
    r = await client.post("/classify", content=b'{"texts": ["fine", "\\ud800", 5], "extra": NaN}', headers=JSON)
    details = assert_error_shape(r, 422, "invalid_request")["details"]
    where = {tuple(d["loc"]) for d in details}
    assert {("body", "texts", 1), ("body", "texts", 2), ("body", "extra")} <= where
    assert any("not valid Unicode" in d["msg"] for d in details)


async def test_text_with_a_visible_character_among_invisible_ones_is_served(client):
    r = await client.post("/classify", json={"text": "\u200b\ufeff film \u200b"})
    assert r.status_code == 200


async def test_errors_from_the_framework_use_the_same_shape(client):
    assert_error_shape(await client.get("/no-such-route"), 404, "not_found")
    assert_error_shape(await client.get("/classify"), 405, "method_not_allowed")
    assert_error_shape(await client.post("/classify", content=b"x" * 70_000, headers=JSON), 413, "body_too_large")
    r = await client.post("/classify", json={"text": "the film"}, headers={"x-request-id": "mine-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
    r = await client.post("/classify", json={"text": ""}, headers={"x-request-id": "mine-2"})
    assert assert_error_shape(r, 422)["request_id"] == "mine-2"


async def test_openapi_documents_every_status_a_task_route_answers(client):
    spec = (await client.get("/openapi.json")).json()
    for path in ("/classify", "/translate"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "408", "413", "422", "429", "431", "499", "500", "503", "504"}
        for status in set(responses) - {"200"}:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "503" in spec["paths"]["/readyz"]["get"]["responses"]


# ---- readiness tells the truth ----


async def test_a_configured_model_that_cannot_load_makes_readyz_503_naming_it(models_dir):
    settings = make_settings(models_dir, translate_model="no-such-bundle")
    async with running_service(settings) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["ready"] is False and body["not_loaded"] == ["no-such-bundle"]
        assert body["models"] == ["classify-linformer"]  # the one that loaded still serves
        assert "no-such-bundle" in body["detail"] and str(models_dir) not in ready.text
        assert (await client.post("/classify", json={"text": "the film"})).status_code == 200
        r = await client.post("/translate", json={"text": "the film"})
        assert "no-such-bundle" in assert_error_shape(r, 503, "unavailable")["message"]
        assert str(models_dir) not in r.text


async def test_a_models_dir_outside_the_tree_shows_no_path_to_clients(tmp_path):
    settings = make_settings(tmp_path / ".." / ".." / "etc")
    async with running_service(settings) as client:
        for r in (await client.get("/readyz"), await client.post("/classify", json={"text": "a"})):
            assert r.status_code == 503 and "etc" not in r.text and "/" not in r.json().get("detail", "")


async def test_an_empty_model_name_means_not_configured_and_ready_without_it(models_dir):
    async with running_service(make_settings(models_dir, translate_model="")) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["not_loaded"] == []
        r = await client.post("/translate", json={"text": "the film"})
        assert assert_error_shape(r, 503, "unavailable")["message"] == "this server is not configured to translate"


# ---- an inference error fails only its own batch ----


class FailingOnce:
    """Raises on the first batch only, as a runtime hit by a transient fault would."""

    def __init__(self, runtime):
        self.runtime, self.calls = runtime, 0

    def run(self, input_ids, attention_mask):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: ORT failed on this batch")
        return self.runtime.run(input_ids, attention_mask)


async def test_an_inference_error_fails_only_that_batch_and_the_next_is_served(models_dir, caplog):
    settings = make_settings(models_dir, translate_model="", max_batch_size=2)
    async with running_service(settings, wrap_runtime=FailingOnce) as client:
        failed = await client.post("/classify", json={"texts": ["the film", "bad"]}, headers={"x-request-id": "f-1"})
        error = assert_error_shape(failed, 500, "inference_failed")
        assert error["request_id"] == "f-1" and "injected" not in error["message"]  # the cause is logged, not sent
        served = await client.post("/classify", json={"texts": ["the film", "bad"]})
        assert served.status_code == 200 and len(served.json()["results"]) == 2
        assert (await client.get("/readyz")).status_code == 200
    assert "injected: ORT failed on this batch" in caplog.text


async def _released_once_idle(runtime, released_within_s: float = 6.0) -> bool:
    for _ in range(int(released_within_s * 10)):
        if not runtime.holding:
            return True
        await asyncio.sleep(0.1)
    return False


def _keeping(runtimes: list):
    def keep(runtime):
        runtimes.append(runtime)
        return runtime

    return keep


async def test_the_classifier_holds_a_big_batchs_memory_while_busy_and_gives_it_back_once_idle(models_dir):
    """A batch of at least LINFORMER_ORT_ARENA_SHRINK_TOKENS padded tokens leaves its memory in ORT's arena, for the
    next big batch (given back after each one, a 4,096-token text paid ~21 ms of page faults on a ~48 ms run); once
    the model has had no batch for LINFORMER_MEMORY_RELEASE_S the compute thread gives it back."""
    runtimes = []
    settings = make_settings(models_dir, translate_model="", ort_arena_shrink_tokens=32, memory_release_s=2.0)
    async with running_service(settings, wrap_runtime=_keeping(runtimes)) as client:
        [runtime] = runtimes
        small = await client.post("/classify", json={"text": "the film"})
        assert small.status_code == 200 and not runtime.holding
        big = await client.post("/classify", json={"texts": ["a long and moving film " * 8] * 2})
        assert big.status_code == 200 and runtime.holding  # kept for the next big batch
        assert await _released_once_idle(runtime)  # given back after about two seconds of idling


@pytest.mark.parametrize("scheduling", ["request", "step"])
async def test_the_translator_keeps_a_big_decodes_freed_pages_until_the_model_idles(translate_models_dir, monkeypatch,
                                                                                    scheduling):  # fmt: skip
    """A decode whose buffers reached BIG_DECODE_BYTES (here: any) leaves the pages it freed to the process until the
    model has had no batch for LINFORMER_MEMORY_RELEASE_S (trimmed at its end, a single stream of paragraphs spent
    about twice the system time), under either scheduling."""
    import service.runtime

    monkeypatch.setattr(service.runtime, "BIG_DECODE_BYTES", 0)
    runtimes = []
    settings = make_settings(translate_models_dir, classify_model="", memory_release_s=2.0,
                             translate_scheduling=scheduling)  # fmt: skip
    async with running_service(settings, wrap_runtime=_keeping(runtimes)) as client:
        [runtime] = runtimes
        answer = await client.post("/translate", json={"text": "the film was good"})
        assert answer.status_code == 200 and runtime.holding
        assert await _released_once_idle(runtime)


async def test_an_unexpected_exception_is_a_500_in_the_error_shape(models_dir):
    from service.app import create_app

    app = create_app(make_settings(models_dir, translate_model=""))

    @app.get("/boom")
    async def boom():
        raise ZeroDivisionError("hidden")

    import httpx

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            r = await client.get("/boom")
    assert "hidden" not in assert_error_shape(r, 500, "internal_error")["message"]


# ---- admission control: refuse before reading the body ----


async def test_over_the_concurrency_limit_is_429_before_the_body_is_read(models_dir):
    from service.app import create_app

    slow = None

    def wrap(runtime):
        nonlocal slow
        slow = SlowRuntime(runtime, 0.3)
        return slow

    settings = make_settings(models_dir, translate_model="", max_concurrent_requests=1, max_waiting_requests=0)
    app = create_app(settings, wrap_runtime=wrap)
    async with app.router.lifespan_context(app):
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            busy = asyncio.create_task(client.post("/classify", json={"text": "the film"}))
            await asyncio.sleep(0.05)
            # a client that never sends its body still gets its 429 at once: the body is not needed to refuse
            started = time.monotonic()
            status, headers, body = await _asgi_post_without_body(app)
            assert time.monotonic() - started < 0.2
            assert status == 429 and int(headers[b"retry-after"]) >= 1
            error = json.loads(body)["error"]
            assert error["code"] == "overloaded" and "LINFORMER_MAX_CONCURRENT_REQUESTS" in error["message"]
            assert error["request_id"] == headers[b"x-request-id"].decode()
            assert (await busy).status_code == 200
            assert (await client.get("/healthz")).status_code == 200  # ops routes are never refused
            assert (await client.post("/classify", json={"text": "bad"})).status_code == 200  # the slot is free
            metrics = (await client.get("/metrics")).text
            assert 'linformer_rejected_requests_total{reason="concurrency",route="/classify"} 1.0' in metrics


def test_translate_has_limits_of_its_own_and_its_refusals_name_them(models_dir):
    """A translation costs several classifications and its request-level batches take every queued sentence, so
    /translate lets fewer requests in before a flood is recognised and more while it sheds (32 and 32, its own
    settings); /classify keeps LINFORMER_MAX_CONCURRENT_REQUESTS and LINFORMER_SHED_CONCURRENT_REQUESTS."""
    from service.app import create_app

    def request_context(**settings):
        app = create_app(make_settings(models_dir, translate_model="", **settings))
        app.build_middleware_stack()  # (else built on the first request)
        return app.request_context

    admission = request_context().admission
    assert (admission["/classify"].burst_limit, admission["/classify"].shed_limit) == (128, 16)
    assert (admission["/translate"].burst_limit, admission["/translate"].shed_limit) == (32, 32)
    context = request_context(max_concurrent_requests=7, shed_concurrent_requests=3,
                              translate_max_concurrent_requests=5, translate_shed_concurrent_requests=4)  # fmt: skip
    assert (context.admission["/classify"].burst_limit, context.admission["/classify"].shed_limit) == (7, 3)
    assert (context.admission["/translate"].burst_limit, context.admission["/translate"].shed_limit) == (5, 4)
    full, shedding = context._at_capacity("/translate", shedding=False), context._at_capacity("/translate", True)
    assert "(5 requests in progress" in full and "LINFORMER_TRANSLATE_MAX_CONCURRENT_REQUESTS" in full
    assert "(4 requests in progress" in shedding and "LINFORMER_TRANSLATE_SHED_CONCURRENT_REQUESTS" in shedding
    assert "TRANSLATE" not in context._at_capacity("/classify", False) + context._at_capacity("/classify", True)


async def test_over_the_burst_limit_a_request_waits_for_a_slot_instead_of_being_refused(models_dir):
    """A pile-up over LINFORMER_MAX_CONCURRENT_REQUESTS (a stall of the core) waits and is served, first come first
    served; only with the waiting room full too is a request refused, naming both settings."""
    from service.app import create_app

    settings = make_settings(models_dir, translate_model="", max_concurrent_requests=1, max_waiting_requests=2)
    app = create_app(settings, wrap_runtime=lambda runtime: SlowRuntime(runtime, 0.2))
    async with app.router.lifespan_context(app):
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:

            def started():
                return asyncio.create_task(client.post("/classify", json={"text": "the film"}))

            pile = [started()]
            await asyncio.sleep(0.05)
            pile += [started(), started()]  # over the burst limit: they wait
            await asyncio.sleep(0.05)
            refused = await started()  # the waiting room is full as well
            assert refused.status_code == 429
            message = refused.json()["error"]["message"]
            assert "LINFORMER_MAX_CONCURRENT_REQUESTS" in message and "LINFORMER_MAX_WAITING_REQUESTS" in message
            assert [r.status_code for r in await asyncio.gather(*pile)] == [200, 200, 200]
            assert app.request_context.admission["/classify"].in_flight == 0


async def test_when_a_flood_begins_to_be_shed_the_queue_refuses_what_the_burst_let_in_beyond_the_shed_limit(models_dir):
    """A flood's first windows let in the whole burst limit; once the route sheds, the model's queue keeps only the
    shed limit's oldest requests and answers the rest 429 at once (nothing computed for them), instead of serving
    them after that backlog."""
    from service.app import create_app

    slow = None

    def wrap(runtime):
        nonlocal slow
        slow = SlowRuntime(runtime, 0.2)
        return slow

    settings = make_settings(models_dir, translate_model="", max_batch_size=1, max_concurrent_requests=8,
                             shed_concurrent_requests=2)  # fmt: skip
    app = create_app(settings, wrap_runtime=wrap)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            burst = [asyncio.create_task(client.post("/classify", json={"text": "the film"})) for _ in range(8)]
            flood = []
            for _ in range(40):  # one arrival every 10 ms while a batch takes 200 ms: the route sheds
                await asyncio.sleep(0.01)
                flood.append(asyncio.create_task(client.post("/classify", json={"text": "the film"})))
            answers = await asyncio.gather(*burst, *flood)
            metrics = (await client.get("/metrics")).text
    shed = [r for r in answers[:8] if r.status_code == 429]
    assert len(shed) >= 3, [r.status_code for r in answers[:8]]  # 8 let in, at most 1 computing + 2 kept + 2 more
    for r in shed:
        error = r.json()["error"]
        assert error["code"] == "overloaded" and "began shedding a flood" in error["message"]
        assert int(r.headers["retry-after"]) >= 1 and error["request_id"] == r.headers["x-request-id"]
    assert {r.status_code for r in answers} == {200, 429}
    assert len(slow.batches) == sum(r.status_code == 200 for r in answers)  # nothing computed for a shed request
    assert f'linformer_rejected_requests_total{{reason="shed",route="/classify"}} {len(shed)}.0' in metrics

class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _settle():
    for _ in range(3):
        await asyncio.sleep(0)


class _Traffic:
    """Drives a RouteAdmission on a test clock: each step, `arrivals` requests arrive (those told to wait wait for a
    slot) and up to `completions` of those in progress complete."""

    def __init__(self, route, clock: _Clock):
        self.route, self.clock = route, clock
        self.waiters: list[asyncio.Future] = []
        self.outcomes: list = []

    async def step(self, arrivals: int, completions: int, tick_s: float = 0.01) -> None:
        from service.middleware import Admission

        self.clock.now += tick_s
        for _ in range(arrivals):
            decision = self.route.arrive()
            self.outcomes.append(decision)
            if decision is Admission.WAIT:
                self.waiters.append(asyncio.ensure_future(self.route.wait_for_slot(60)))
        for _ in range(min(completions, self.route.in_flight)):
            self.route.complete()
        await _settle()


async def test_admission_serves_a_stalls_pile_without_refusing_it():
    """A stall: requests pile up at once (read together when the core is back), then arrive at their usual rate,
    slower than a model working off a backlog completes them. The pile waits (held back while its window looks
    flooded) and is served; nothing is refused and the route never sheds."""
    from service.middleware import Admission, RouteAdmission

    clock = _Clock()
    route = RouteAdmission(burst_limit=8, shed_limit=4, max_waiting=64, clock=clock)
    assert [route.arrive() for _ in range(8)] == [Admission.ADMIT] * 8
    waiters = []
    for _ in range(30):  # the pile: over the burst limit, so they wait
        assert route.arrive() is Admission.WAIT
        waiters.append(asyncio.ensure_future(route.wait_for_slot(60)))
    await _settle()
    route.complete()  # a slot frees, but this window looks flooded: the pile is held back
    await _settle()
    assert route.in_flight == 7 and not any(w.done() for w in waiters)
    admitted, completed = 8, 1
    for tick in range(60):  # then: 2 arrivals and 3 completions per 10 ms, 0.7 arrivals per completion
        clock.now += 0.01
        for _ in range(2):
            decision = route.arrive()
            assert decision is not Admission.REFUSE
            if decision is Admission.WAIT:
                waiters.append(asyncio.ensure_future(route.wait_for_slot(60)))
            admitted += 1
        for _ in range(min(3, route.in_flight)):
            route.complete()
            completed += 1
        await _settle()
        assert not route.shedding, tick
    assert all(w.done() and w.result() is Admission.ADMIT for w in waiters)  # every waiting request got a slot
    assert route.in_flight + completed == admitted + 30 and route.in_flight < 8  # the backlog is worked off


async def test_admission_sheds_a_flood_refuses_its_waiting_requests_and_recovers():
    """A flood: arrivals keep coming at over twice the completion rate. After two such windows the waiting requests
    are refused and only the shedding limit is in progress; once a quarter second passes without a flooded window,
    the burst limit is back."""
    from service.middleware import FLOOD_WINDOW_S, Admission, RouteAdmission

    route = RouteAdmission(burst_limit=8, shed_limit=4, max_waiting=1000, clock=(clock := _Clock()))
    traffic = _Traffic(route, clock)
    for _ in range(int(2.5 * FLOOD_WINDOW_S / 0.01)):  # 10 arrivals and 3 completions per 10 ms
        await traffic.step(10, 3)
    assert route.shedding and route.limit == 4
    waiters = traffic.waiters
    assert waiters and all(w.done() for w in waiters)
    # refused once the flood was recognised
    assert sum(w.result() is Admission.REFUSE for w in waiters) > 0.8 * len(waiters)
    traffic.outcomes.clear()
    for _ in range(20):
        await traffic.step(10, 3)
    assert route.in_flight <= 4 and Admission.WAIT not in traffic.outcomes and Admission.REFUSE in traffic.outcomes
    for _ in range(60):  # the flood is over: fewer arrivals than completions
        await traffic.step(1, 3)
    assert not route.shedding and route.limit == 8


async def test_a_route_that_sheds_keeps_shedding_while_requests_arrive_faster_than_they_complete():
    """Once shedding, the route stops only when requests no longer arrive faster than they complete, not as soon as a
    window has fewer than FLOOD_RATIO arrivals per completion: under a flood, batched completions made such windows
    often enough to let the burst and the waiting room in mid-flood. Starting to shed still takes the full test, and
    when shedding begins the queue is told how many requests to keep."""
    from service.middleware import FLOOD_WINDOW_S, RouteAdmission

    told = []
    route = RouteAdmission(burst_limit=8, shed_limit=4, max_waiting=1000, clock=(clock := _Clock()),
                           on_shed=told.append)  # fmt: skip
    traffic = _Traffic(route, clock)
    for _ in range(int(2.5 * FLOOD_WINDOW_S / 0.01)):  # 10 arrivals and 3 completions per 10 ms: a flood
        await traffic.step(10, 3)
    assert route.shedding and told == [4]
    for _ in range(50):  # 1.5 arrivals per completion for half a second: less than the bar to start, still a flood
        await traffic.step(6, 4)
        assert route.shedding and route.in_flight <= 4
    assert told == [4]  # told once, when shedding began
    for _ in range(40):  # arrivals fall below completions: the flood is over
        await traffic.step(2, 4)
    assert not route.shedding and route.limit == 8


async def test_a_flood_whose_batched_completions_make_every_other_window_unclear_is_still_shed():
    """Windows between the flood bar and calm (here 1.7 arrivals per completion, every other window: batched
    completions) neither break the run of flooded windows that starts shedding nor count as calm: the flood is shed
    and its waiting requests refused, not let in during the unclear window."""
    from service.middleware import Admission, RouteAdmission

    route = RouteAdmission(burst_limit=200, shed_limit=4, max_waiting=1000, clock=(clock := _Clock()))
    traffic = _Traffic(route, clock)

    async def window(arrivals: int, completions: int, first: int = 0) -> None:  # 10 ticks of 10.1 ms: one window
        for tick in range(10):
            await traffic.step(arrivals + (first if tick == 0 else 0), completions, tick_s=0.0101)

    await window(10, 3, first=200)  # the burst limit fills at once, then 3.3 arrivals per completion: flooded
    admitted = route.in_flight
    await window(10, 6)  # 1.7 arrivals per completion: unclear, and the waiting requests stay held
    assert not route.shedding and route.in_flight == admitted - 60
    await window(10, 3)  # flooded again: the second flooded window with no calm one between
    await window(10, 3)  # (the verdict on a window comes at its turn)
    assert route.shedding
    assert traffic.waiters and all(w.done() and w.result() is Admission.REFUSE for w in traffic.waiters)


async def test_admission_holds_a_floods_waiting_requests_across_the_window_turn_until_it_sheds():
    """A flood's first window fills the burst limit and the waiting room. When the next window starts, slots that
    free up do not go to those waiting requests (they would be served late, after their time in the room and the
    burst): the new window has to show it is not a flood first. It does not, so they are refused when shedding
    starts at its end."""
    from service.middleware import FLOOD_WINDOW_S, Admission, RouteAdmission

    # a burst limit the model takes longer than a window to work off, as 128 requests on one core
    route = RouteAdmission(burst_limit=40, shed_limit=4, max_waiting=1000, clock=(clock := _Clock()))
    traffic = _Traffic(route, clock)
    waiters = traffic.waiters
    second_window = False
    for _ in range(round(4 * FLOOD_WINDOW_S / 0.01)):  # 10 arrivals and 3 completions per 10 ms
        await traffic.step(10, 3)
        if route.shedding:
            break
        assert not any(w.done() for w in waiters)  # held back, also once slots are free
        if route._flooded_windows == 1 and not second_window:  # the first window was judged: the second begins
            second_window = True
            assert 0 < route.in_flight < route.limit and waiters  # slots free at the turn, work in progress
    assert second_window and route.shedding
    assert all(w.done() and w.result() is Admission.REFUSE for w in waiters)


def test_the_refusal_limit_grows_with_the_requests_the_routes_complete():
    """Refusals beyond max_refusals_per_s are held, unless the routes complete requests fast enough that
    refusals_per_completion of them a second is more: then that rate. A fixed rate held the refusals of a 3x flood on
    a faster machine (and with them its clients' connections)."""
    from service.deps import ServiceState
    from service.metrics import Metrics
    from service.middleware import FLOOD_WINDOW_S, REFUSAL_BURST_S, RequestContextMiddleware

    settings = make_settings("models", max_refusals_per_s=100, refusals_per_completion=3)
    context = RequestContextMiddleware(None, state=ServiceState(settings, Metrics()))
    clock = _Clock()
    route = context.admission["/classify"]
    route.clock = clock

    def answered_at_once(refusals: int) -> int:
        context._next_refusal_at = -1e9  # a fresh burst allowance for each count
        return sum(context.refusal_delay() == 0.0 for _ in range(refusals))

    # no completion yet: the fixed rate, 100 a second, answers a tenth of a second's burst (10) at once (the real clock
    # moves meanwhile: a few more)
    assert answered_at_once(1000) == pytest.approx(100 * REFUSAL_BURST_S, rel=0.1)
    for _ in range(100):  # a window in which 100 requests complete: 1,000 a second
        route.arrive()
        route.complete()
    clock.now += FLOOD_WINDOW_S
    route.arrive()  # the window ends: its completions are counted
    assert route.completed_per_s == pytest.approx(1000)
    assert answered_at_once(1000) == pytest.approx(3 * 1000 * REFUSAL_BURST_S, rel=0.1)
    clock.now += 10 * FLOOD_WINDOW_S  # a long quiet spell: nothing completes, the fixed rate again
    route.arrive()
    assert route.completed_per_s == 0
    assert answered_at_once(1000) == pytest.approx(100 * REFUSAL_BURST_S, rel=0.1)


async def test_admission_refuses_when_the_waiting_room_is_full_and_a_left_waiter_frees_its_place():
    from service.middleware import Admission, RouteAdmission

    route = RouteAdmission(burst_limit=1, shed_limit=1, max_waiting=1, clock=_Clock())
    assert route.arrive() is Admission.ADMIT
    assert route.arrive() is Admission.WAIT
    waiter = asyncio.ensure_future(route.wait_for_slot(60))
    await _settle()
    assert route.arrive() is Admission.REFUSE
    waiter.cancel()  # its client left
    await _settle()
    assert not route.waiting and route.arrive() is Admission.WAIT


class _RecordingTransport:
    """Enough of an asyncio transport for uvicorn's protocol, keeping what is written."""

    def __init__(self):
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def test_a_refusal_is_written_by_the_header_parser_callback_without_an_asgi_task(models_dir):
    """The served protocol answers a 429 inside the parser callback, before uvicorn starts an ASGI task, keeps the
    connection for the next request, and lets a request under the limit through to the app. Written against
    uvicorn's callbacks (on_headers_complete, self.url/headers/cycle): this fails if an upgrade changes them."""
    import uvicorn
    from uvicorn.server import ServerState

    from service.__main__ import _admitting_protocol
    from service.app import create_app
    from service.middleware import ADMISSION_SCOPE_KEY, Admission

    settings = make_settings(models_dir, translate_model="", max_concurrent_requests=1, max_waiting_requests=0)
    app = create_app(settings)
    protocol_class = _admitting_protocol(app)
    config = uvicorn.Config(app, http=protocol_class, log_config=None)
    config.load()
    app.build_middleware_stack()
    server_state = ServerState()
    protocol = protocol_class(config, server_state, {}, _loop=asyncio.get_running_loop())
    transport = _RecordingTransport()
    protocol.connection_made(transport)
    body = b'{"text": "the film"}'
    request = b"POST /classify HTTP/1.1\r\nhost: x\r\nx-request-id: r-7\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body), body)  # fmt: skip

    admission = app.request_context.admission["/classify"]
    admission.in_flight = 1  # at capacity, and no room to wait
    protocol.data_received(request)
    head, _, answer = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in head and b"x-request-id: r-7" in head
    assert b"content-length: %d" % len(answer) in head
    assert json.loads(answer)["error"] == {
        "code": "overloaded", "request_id": "r-7",
        "message": "/classify is at capacity (1 requests in progress and 0 waiting, LINFORMER_MAX_CONCURRENT_REQUESTS "
                   "and LINFORMER_MAX_WAITING_REQUESTS); retry after the time in Retry-After",
    }  # fmt: skip
    assert not server_state.tasks and not transport.closed and server_state.total_requests == 1

    transport.written = b""
    admission.in_flight = 0  # a slot is free: the same connection reaches the app
    protocol.data_received(request)
    assert transport.written == b"" and len(server_state.tasks) == 1
    # the slot was taken in the callback, before the task runs: a second request read in the same turn of the event
    # loop is refused there, instead of both getting a task and one being refused in it
    assert admission.in_flight == 1 and protocol.scope[ADMISSION_SCOPE_KEY] is Admission.ADMIT
    other = _RecordingTransport()
    other_protocol = protocol_class(config, server_state, {}, _loop=asyncio.get_running_loop())
    other_protocol.connection_made(other)
    other_protocol.data_received(request)
    assert other.written.startswith(b"HTTP/1.1 429 ") and len(server_state.tasks) == 1
    other_protocol.connection_lost(None)
    for task in list(server_state.tasks):
        task.cancel()  # the app's lifespan is not running here: only that the request got its task matters
    protocol.connection_lost(None)


class _WritesTransport(_RecordingTransport):
    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        super().write(data)


async def test_each_answer_is_one_write(models_dir):
    """uvicorn writes a response's head and its body apart: two system calls and two TCP segments an answer, on
    the core the model runs on. The served protocol writes each answer once: a body-carrying one, a HEAD answer
    (no body), and one whose client asked for 100 Continue (that line goes out first, alone, as it must)."""
    import uvicorn
    from uvicorn.server import ServerState

    from service.__main__ import _admitting_protocol
    from service.app import create_app

    app = create_app(make_settings(models_dir, translate_model=""))
    protocol_class = _admitting_protocol(app)
    config = uvicorn.Config(app, http=protocol_class, log_config=None)
    config.load()
    server_state = ServerState()
    body = b'{"text": "the film was wonderful"}'
    post = b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)

    async def answered(protocol: asyncio.Protocol, transport: _WritesTransport, request: bytes) -> list[bytes]:
        transport.writes.clear()
        protocol.data_received(request)
        await asyncio.gather(*server_state.tasks)
        return list(transport.writes)

    async with app.router.lifespan_context(app):
        protocol = protocol_class(config, server_state, {}, _loop=asyncio.get_running_loop())
        transport = _WritesTransport()
        protocol.connection_made(transport)
        [answer] = await answered(protocol, transport, post + b"\r\n" + body)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and json.loads(payload)["results"][0]["tokens"] > 0
        [head_only] = await answered(protocol, transport, b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert head_only.startswith(b"HTTP/1.1 200 ") and head_only.endswith(b"\r\n\r\n")
        assert b"\r\ncontent-length: " in head_only
        [answer] = await answered(protocol, transport, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'"ok"}')

        transport.writes.clear()
        protocol.data_received(post + b"expect: 100-continue\r\n\r\n")
        for _ in range(100):  # the app asks for the body: uvicorn says 100 Continue first
            if transport.writes:
                break
            await asyncio.sleep(0.01)
        assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        protocol.data_received(body)
        await asyncio.gather(*server_state.tasks)
        assert len(transport.writes) == 2 and transport.writes[1].startswith(b"HTTP/1.1 200 ")
        protocol.connection_lost(None)


async def _asgi_post_without_body(app) -> tuple[int, dict, bytes]:
    sent: list[dict] = []
    never = asyncio.Event()

    async def receive():
        await never.wait()  # the body never arrives

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/classify", "raw_path": b"/classify", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 12345), "server": ("service", 80),
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 1)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


# ---- bounded work per /translate request ----


async def test_translate_over_the_decode_budget_is_413_naming_the_limit(translate_models_dir):
    settings = make_settings(translate_models_dir, classify_model="", max_decode_tokens_per_request=64)
    async with running_service(settings) as client:
        # tiny bundle: tgt_n_max = 16, so max_new_tokens is worth at most 16 per beam
        r = await client.post("/translate", json={"texts": ["the film", "bad"], "beam_size": 4, "max_new_tokens": 9})
        error = assert_error_shape(r, 413, "budget_exceeded")
        assert "2 or more sentences x beam_size 4 may generate at least 72 decode tokens (max_new_tokens 9 each" in (
            error["message"])
        assert "limit of 64" in error["message"] and "LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST" in error["message"]
        ok = await client.post("/translate", json={"texts": ["the film", "bad"], "beam_size": 2, "max_new_tokens": 16})
        assert ok.status_code == 200  # 2 x 2 x 16 = 64: at the limit is fine
        capped = await client.post("/translate", json={"text": "the film", "beam_size": 4, "max_new_tokens": 4096})
        assert capped.status_code == 200  # 4096 is capped at the model's 16 target tokens: 4 x 16 = 64


async def test_more_sentences_than_the_decode_budget_pays_for_are_refused_before_any_is_encoded(
        translate_models_dir, monkeypatch):  # fmt: skip
    """The budget was checked once every sentence was encoded: a 1 MB text of 500,000 one-letter lines took 5 s of
    the event loop (the whole server stalled) to be refused. Now the split stops at the first row over what the
    budget can pay for at the least a row costs, and nothing is encoded."""
    from service.tokenizer import Tokenizer, split_sentences

    encoded = []
    monkeypatch.setattr(Tokenizer, "encode_all", lambda self, texts, truncate: encoded.append(texts) or [])
    settings = make_settings(translate_models_dir, classify_model="", max_decode_tokens_per_request=64)
    async with running_service(settings) as client:
        r = await client.post("/translate", json={"text": "a\n" * 10_000, "max_new_tokens": 16})
    error = assert_error_shape(r, 413, "budget_exceeded")
    assert "5 or more sentences x beam_size 1 may generate at least 80 decode tokens" in error["message"]
    assert encoded == []
    assert len(split_sentences("a\n" * 10_000, at_most=4)) == 5  # the split itself stops there


def test_the_decode_budget_counts_what_each_sentence_may_generate():
    """Where a row may generate more than the least (a model whose target length is over twice a short source +
    16), the budget is checked on every row's own cost, once encoded."""
    from service.routes import _decode_costs
    from service.tokenizer import Encoded

    rows = [Encoded(list(range(20)), False), Encoded(list(range(3)), False)]
    # 2 x min(100, 2 x 20 + 16), 2 x (2 x 3 + 16)
    assert _decode_costs(256, "sentences", rows, 2, 100, 200) == [112, 44]
    with pytest.raises(ServiceError) as refused:
        _decode_costs(256, "sentences", rows, 2, 100, 155)
    assert refused.value.status == 413 and "2 sentences x beam_size 2 may generate 156 decode tokens" in (
        refused.value.message)


async def test_translate_queue_is_bounded_by_decode_tokens_not_requests(translate_models_dir):
    from service.app import create_app
    from service.batcher import Batcher, QueueFull

    app = create_app(make_settings(translate_models_dir, classify_model="", max_queued_decode_tokens=40,
                                   max_decode_tokens_per_request=40))
    async with app.router.lifespan_context(app):
        assert app.state.service.models["translate"].batcher.max_queue == 40

    def never_done(input_ids, attention_mask, options, stop_if_abandoned):
        time.sleep(0.3)
        return [[]] * len(input_ids)

    batcher = Batcher(never_done, name="t", pad_id=0, max_batch_size=1, max_batch_tokens=100, max_wait_s=0,
                      max_queue=40)  # fmt: skip
    batcher.start()
    computing = asyncio.create_task(batcher.submit([[1]], timeout_s=5, cost=16))
    await asyncio.sleep(0.05)  # out of the queue, computing
    queued = asyncio.create_task(batcher.submit([[1], [1]], timeout_s=5, cost=16))  # 32 of 40
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await batcher.submit([[1]], timeout_s=5, cost=16)  # one text, but 48 > 40
    assert await batcher.submit([[1]], timeout_s=5, cost=8) == [[]]  # 40: fits
    await asyncio.gather(computing, queued)
    await batcher.close()


async def test_a_translation_batch_nobody_waits_for_stops_decoding():
    """Past every request's deadline the runtime is stopped between steps instead of decoding on."""
    from service.batcher import Batcher, DeadlineExceeded

    steps = []

    def step_by_step(input_ids, attention_mask, options, stop_if_abandoned):
        for step in range(200):
            stop_if_abandoned()
            steps.append(step)
            time.sleep(0.005)
        return [[]] * len(input_ids)

    batcher = Batcher(step_by_step, name="t", pad_id=0, max_batch_size=8, max_batch_tokens=100, max_wait_s=0,
                      max_queue=100)  # fmt: skip
    batcher.start()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit([[1, 2], [3]], timeout_s=0.1)
    await batcher.close()
    assert 5 < len(steps) < 60  # stopped near 0.1 s, far from the 200 steps (1 s) asked for


async def test_the_translator_asks_between_every_decoder_step(translate_models_dir):
    """The real runtime calls the batcher's hook before each decoder call, so stopping takes one step at most."""
    calls = {"hook": 0, "decoder": 0}

    def wrap(runtime):
        decoder = runtime.decoder

        class CountingDecoder:
            def run_with_iobinding(self, *args, **kwargs):  # the runtime's decoder call (IO-bound buffers)
                calls["decoder"] += 1
                return decoder.run_with_iobinding(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(decoder, name)

        runtime.decoder = CountingDecoder()

        class Hooked:
            def run(self, input_ids, attention_mask, options, between_steps):
                def counted():
                    calls["hook"] += 1
                    between_steps()

                return runtime.run(input_ids, attention_mask, options, counted)

        return Hooked()

    settings = make_settings(translate_models_dir, classify_model="", translate_scheduling="request")  # whole batches
    async with running_service(settings, wrap_runtime=wrap) as client:
        for beam in (1, 3):
            r = await client.post("/translate", json={"texts": ["the film", "a bad movie"], "beam_size": beam})
            assert r.status_code == 200
    assert calls["decoder"] > 0 and calls["hook"] == calls["decoder"]


# ---- the OpenAPI schema and the server agree (what schemathesis checks in `make fuzz`) ----


async def test_the_schema_states_what_the_server_enforces(client):
    import re

    from service.schemas import VISIBLE_CHARACTER

    spec = (await client.get("/openapi.json")).json()["components"]["schemas"]["ClassifyRequest"]
    assert spec["oneOf"] == [{"required": ["text"]}, {"required": ["texts"]}]
    assert spec["properties"]["texts"]["maxItems"] == 8  # this server's LINFORMER_MAX_TEXTS_PER_REQUEST
    assert spec["properties"]["text"]["pattern"] == VISIBLE_CHARACTER
    for text in ["\u200b\u200b\ufeff", " \t", "\x00"]:  # the pattern refuses what the server refuses...
        assert not re.search(VISIBLE_CHARACTER, text)
        assert (await client.post("/classify", json={"text": text})).status_code == 422
    for text in ["a", "\u200bfilm", "\u00e9"]:  # ...and allows what it serves
        assert re.search(VISIBLE_CHARACTER, text)
        assert (await client.post("/classify", json={"text": text})).status_code == 200
    assert (await client.post("/classify", json={"text": None, "texts": ["a"]})).status_code == 422  # not nullable


async def test_an_integral_float_is_an_integer_as_in_json_schema(translate_models_dir):
    async with running_service(make_settings(translate_models_dir, classify_model="")) as client:
        assert (await client.post("/translate", json={"text": "the film", "beam_size": 2.0})).status_code == 200
        for bad in (2.5, "2", float("inf")):
            r = await client.post("/translate", content=json.dumps({"text": "a", "beam_size": bad}), headers=JSON)
            assert_error_shape(r, 422, "invalid_request")


def test_settings_where_one_allowed_request_cannot_fit_an_empty_queue_are_refused(models_dir):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="LINFORMER_MAX_TEXTS_PER_REQUEST=64 exceeds LINFORMER_MAX_QUEUE=10"):
        make_settings(models_dir, max_queue=10)
    with pytest.raises(ValidationError, match="exceeds LINFORMER_MAX_QUEUED_DECODE_TOKENS=1000"):
        make_settings(models_dir, max_queued_decode_tokens=1000)


async def test_admission_a_held_back_pile_gets_its_slots_when_nothing_else_happens():
    """A burst of one-off requests (a batch job, no client sends again): more arrive at once than twice what
    completes in the window, so the window looks flooded and the pile over the burst limit is held back. Every
    request in progress then completes and no event follows: the pile must still get its slots when the window
    ends, not wait for an arrival that never comes."""
    from service.middleware import FLOOD_WINDOW_S, Admission, RouteAdmission

    clock = _Clock()
    route = RouteAdmission(burst_limit=8, shed_limit=4, max_waiting=64, clock=clock)
    assert [route.arrive() for _ in range(8)] == [Admission.ADMIT] * 8
    waiters = []
    for _ in range(30):
        assert route.arrive() is Admission.WAIT
        waiters.append(asyncio.ensure_future(route.wait_for_slot(60)))
    await _settle()  # they wait
    for _ in range(8):  # in the same window: 38 arrivals, 8 completions
        route.complete()
    await _settle()
    assert route.in_flight == 0 and not any(w.done() for w in waiters)  # held back while the window looks flooded
    clock.now += FLOOD_WINDOW_S  # the window ends; nothing arrives or completes
    await asyncio.sleep(FLOOD_WINDOW_S * 1.5)
    assert sum(w.done() and w.result() is Admission.ADMIT for w in waiters) == 8 and route.in_flight == 8
    assert not route.shedding


async def test_a_request_that_waits_past_its_deadline_is_answered_504_and_never_admitted_late(models_dir):
    """The waiting room is bounded in time too: a request that gets no slot within LINFORMER_REQUEST_TIMEOUT_S is
    answered 504 deadline_exceeded when its deadline passes, not admitted and computed later. (Every request gives
    its slot back by its own deadline, a stalled upload too (408), so behind requests that arrived before it a
    request gets a slot in time; the slot here is held as by one that overran its deadline.)"""
    from service.app import create_app

    settings = make_settings(models_dir, translate_model="", max_concurrent_requests=1, max_waiting_requests=4,
                             request_timeout_s=0.5)  # fmt: skip
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            await client.get("/healthz")  # the first request builds the middleware stack
            admission = app.request_context.admission["/classify"]
            admission.in_flight = 1  # the one slot, held
            started = time.monotonic()
            late = await client.post("/classify", json={"text": "the film"}, headers={"x-request-id": "late-1"})
            waited = time.monotonic() - started
            assert late.status_code == 504 and 0.45 <= waited < 2.0, (late.status_code, waited)
            error = late.json()["error"]
            assert error["code"] == "deadline_exceeded" and error["request_id"] == "late-1"
            assert "LINFORMER_REQUEST_TIMEOUT_S" in error["message"]
            metrics = (await client.get("/metrics")).text
            assert 'linformer_left_waiting_requests_total{reason="deadline",route="/classify"} 1.0' in metrics
            computed = [float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("linformer_batch_size_sum")]  # fmt: skip
            assert sum(computed) == 0  # never computed
            admission.in_flight = 0
            assert (await client.post("/classify", json={"text": "the film"})).status_code == 200  # the slot is free
