"""create_app(settings): load and verify bundles at start-up, serve them, drain the batchers at shutdown.

A configured bundle that is missing leaves the server up but not ready (/readyz 503 naming the model), so an
orchestrator never routes to it; a bundle that exists but fails verification refuses the start (BundleError).
An empty model name means the task is not configured at all.
"""

import gc
import logging
import os
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import onnxruntime as ort
import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from service.batcher import INLINE_MAX_S, Batcher, StepBatcher
from service.bundle import Bundle, BundleError, load_bundle
from service.config import UNCALIBRATED_MAX_BATCH_TOKENS, Settings
from service.deps import ModelService, ServiceState
from service.errors import install_error_handlers
from service.metrics import Metrics
from service.middleware import RequestContextMiddleware
from service.routes import TaskEndpoint, classification_json, classify_answer, router, translate_answer
from service.runtime import ClassifierRuntime, TranslatorRuntime, choose_providers, make_session, probabilities
from service.schemas import ClassifyRequest, TranslateRequest
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Tests wrap the runtime (e.g. to make it slow); the wrapper must keep the wrapped runtime's `run` signature.
RuntimeWrapper = Callable[[ClassifierRuntime | TranslatorRuntime], Any]


def make_runtime(bundle: Bundle, providers: list[str], settings: Settings):
    """The bundle's ONNX sessions behind the runtime's `run`, warmed up once."""

    def session(role: str, cpu_mem_arena: bool = settings.ort_cpu_mem_arena):
        return make_session(bundle.onnx_path(role), providers, intra_op_threads=settings.ort_intra_op_threads,
                            inter_op_threads=settings.ort_inter_op_threads, cpu_mem_arena=cpu_mem_arena)  # fmt: skip

    ids, mask = np.full((1, 8), bundle.eos_id, dtype=np.int64), np.ones((1, 8), dtype=np.int64)
    if bundle.task == "translate":
        config = bundle.config
        runtime = TranslatorRuntime(
            session("encoder"), session("decoder"), n_layers=config["n_decoder_layers"], n_heads=config["n_heads"],
            head_dim=config["head_dim"], tgt_n_max=config["tgt_n_max"], bos_id=bundle.bos_id, eos_id=bundle.eos_id,
            length_penalty_alpha=config.get("export", {}).get("length_penalty_alpha", 0.6),
        )  # fmt: skip
        runtime.run(ids, mask, (1, 4))  # the first runs allocate and pick kernels: not in someone's request
        return runtime
    # the classifier always has its arena; it is shrunk after big batches (once idle) unless told to keep its peak
    shrink_from_tokens = None if settings.ort_cpu_mem_arena else settings.ort_arena_shrink_tokens
    runtime = ClassifierRuntime(session("model", cpu_mem_arena=True), shrink_from_tokens=shrink_from_tokens)
    runtime.run(np.full((1, 8), bundle.bos_id, dtype=np.int64), mask)
    return runtime


def load_models(state: ServiceState, wrap_runtime: RuntimeWrapper | None = None) -> None:
    """Fill `state.models`; a missing bundle goes to `state.unavailable`, a bundle failing verification raises."""
    settings, metrics = state.settings, state.metrics
    providers = choose_providers(settings.execution_provider)
    log.info(
        "execution provider: %s (requested %s; onnxruntime %s offers %s)",
        providers[0], settings.execution_provider, ort.__version__, ort.get_available_providers(),
    )
    for task, name in settings.task_models.items():
        if not name:
            log.info("no %s model configured (LINFORMER_%s_MODEL is empty): /%s answers 503",
                     task, task.upper(), task)  # fmt: skip
            state.unavailable[task] = f"this server is not configured to {task}"
            continue
        path = settings.models_dir / name
        if not path.exists():
            # the path goes to the log only: clients learn the model's name, not the server's file layout
            log.error("%s model %r is not available: no bundle at %s; export one into %s/ (or set "
                      "LINFORMER_MODELS_DIR) and restart", task, name, path, settings.models_dir)  # fmt: skip
            state.unavailable[task] = f"the {task} model {name!r} is not available on this server"
            state.failed[task] = name
            continue
        bundle = load_bundle(path)
        if bundle.task != task:
            raise BundleError(f"bundle {path} is a {bundle.task!r} bundle, configured as the {task} model")
        max_batch_tokens = settings.max_batch_tokens or bundle.max_batch_tokens or UNCALIBRATED_MAX_BATCH_TOKENS
        log.info("%s: batches of at most %d padded tokens (%s)", bundle.name, max_batch_tokens,
                 "LINFORMER_MAX_BATCH_TOKENS" if settings.max_batch_tokens else
                 "measured for this bundle, manifest.json" if bundle.max_batch_tokens else "default")  # fmt: skip
        if bundle.max_batch_size_by_length and not settings.max_batch_tokens:
            log.info("%s: under it, batch sizes per padded length %s (measured, manifest.json)", bundle.name,
                     bundle.max_batch_size_by_length)  # fmt: skip
        try:  # files that match their manifest can still be unusable (exported by a newer ORT, say)
            tokenizer = Tokenizer.from_bundle(bundle)
            runtime = make_runtime(bundle, providers, settings)
        except Exception as e:
            raise BundleError(f"bundle {path} verified but cannot be loaded: {type(e).__name__}: {e}") from e
        runner = wrap_runtime(runtime) if wrap_runtime else runtime
        if task == "translate":  # options = (beam_size, max_new_tokens): the batcher groups equal ones

            def run_batch(input_ids, attention_mask, options, stop_if_abandoned, runner=runner):
                return runner.run(input_ids, attention_mask, options, stop_if_abandoned)
        else:  # one ORT call: nothing to stop half-way; each row comes back as the JSON the route answers

            def run_batch(input_ids, attention_mask, _options, _stop_if_abandoned, runner=runner, labels=bundle.labels):
                return classification_json(probabilities(runner.run(input_ids, attention_mask)), labels)

        batching = dict(
            name=bundle.name,
            pad_id=bundle.pad_id,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=max_batch_tokens,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue=settings.max_queued_decode_tokens if task == "translate" else settings.max_queue,
            metrics=metrics,
            # the measured size per length applies under the measured budget; an explicit budget alone decides
            max_batch_size_by_length=None if settings.max_batch_tokens else bundle.max_batch_size_by_length,
            # a model holding a big batch's memory gives it back once its compute thread has idled a while
            on_idle=runtime.release_memory,
            idle_s=settings.memory_release_s,
        )
        if task == "translate" and settings.translate_scheduling == "step":  # sources join and leave between steps
            # short first steps the narrow width classes alone; the throughput policy steps every row in one call
            short_first = settings.translate_step_short_first
            batcher = StepBatcher(runner.live(width_classes=short_first), short_first=short_first, **batching)
        else:
            cut_in_ratio = settings.translate_cut_in_ratio if task == "translate" else 0
            inline_max_s = INLINE_MAX_S if task == "classify" else 0.0  # a classifier's time follows its input
            batcher = Batcher(run_batch, cut_in_ratio=cut_in_ratio, inline_max_s=inline_max_s, **batching)
        state.models[task] = ModelService(bundle, tokenizer, batcher, execution_provider=runtime.provider)
        log.info(
            "serving %s: task=%s attention=%s n_max=%d k=%s from %s on %s",
            bundle.name, bundle.task, bundle.attention, bundle.n_max, bundle.k, path, runtime.provider,
        )


class ServiceApp(FastAPI):
    """FastAPI with our request middleware outside the framework's own layers (error, telemetry, body-limit
    middleware), so that a request refused at admission costs a dict lookup, not a trip through all of them,
    and POST /classify and /translate go straight to their plain ASGI endpoints."""

    request_context: RequestContextMiddleware | None = None  # built with the stack, on the first request
    # FastAPI asks OpenTelemetry on every request whether a tracer, meter or logger provider is configured (its
    # native telemetry). Asked once when the app starts instead: providers are configured before that (the
    # `opentelemetry-instrument` wrapper, or code run before `python -m service`), and with none, requests go
    # straight to Starlette's call, as FastAPI's own does then.
    telemetry_off = False

    def decide_telemetry(self) -> None:
        native = getattr(self, "_native_telemetry", None)  # a FastAPI without it: its own call, as before
        self.telemetry_off = native is not None and not native.enabled()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.telemetry_off and scope["type"] == "http":
            if self.root_path:
                scope["root_path"] = self.root_path
            await Starlette.__call__(self, scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        state = self.state.service
        endpoints = {"/classify": TaskEndpoint(state, ClassifyRequest, classify_answer),
                     "/translate": TaskEndpoint(state, TranslateRequest, translate_answer)}
        self.request_context = RequestContextMiddleware(super().build_middleware_stack(), state=state,
                                                        endpoints=endpoints)
        return self.request_context

    def openapi(self) -> dict[str, Any]:
        """The schema states this server's texts-per-request limit, so a client (or a fuzzer) reading it knows."""
        if self.openapi_schema is None:
            schema = super().openapi()
            for name in ("ClassifyRequest", "TranslateRequest"):
                texts = schema["components"]["schemas"][name]["properties"]["texts"]
                texts["maxItems"] = self.state.service.settings.max_texts_per_request
        return self.openapi_schema


SWAGGER_ASSETS = "/docs/assets"


def add_offline_docs(app: FastAPI) -> None:
    """/docs with Swagger UI's files from the swagger-ui-bundle package, so it works without internet."""
    app.mount(SWAGGER_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{SWAGGER_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER_ASSETS}/favicon-32x32.png",
        )


def loop_thread_sched_batch() -> bool:
    """Make the calling thread (the event loop's) SCHED_BATCH, which Linux lets any thread do: its wake-ups no longer
    preempt the running thread (the model's), so requests that arrive during a batch are read together once the
    batch or the model's time slice ends; its share of the core stays the fair one (Settings.event_loop_sched_batch).
    Threads started later inherit it. Only from SCHED_OTHER, the default: a policy the operator chose (`chrt`) stays.
    Returns True if it changed it (to put SCHED_OTHER back at shutdown), False where it stays as it was (not Linux,
    another policy, or a sandbox that forbids the call)."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:  # 0: this thread, on Linux
            log.info("event loop thread left at the scheduling policy it was started with")
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.info("event loop thread left at its scheduling policy (%s)", e)
        return False
    return True


def create_app(settings: Settings | None = None, *, wrap_runtime: RuntimeWrapper | None = None) -> FastAPI:
    settings = settings or Settings()
    state = ServiceState(settings=settings, metrics=Metrics())

    @asynccontextmanager
    async def lifespan(app: ServiceApp):
        app.decide_telemetry()
        try:
            load_models(state, wrap_runtime)
        except BundleError as e:
            log.error("refusing to start: %s", e)
            raise
        batchers = [m.batcher for m in state.models.values() if m.batcher is not None]
        for batcher in batchers:
            batcher.start()
        if settings.gc_freeze:
            # the ~10^5 objects of the loaded app move out of the collector's reach: each full collection under
            # load then walks only what requests allocate, instead of pausing every request for all of them
            gc.collect()
            gc.freeze()
        # after the compute threads started: they keep SCHED_OTHER
        sched_batch = settings.event_loop_sched_batch and loop_thread_sched_batch()
        yield
        # uvicorn has stopped accepting and waited for in-flight requests; finish anything still queued
        for batcher in batchers:
            await batcher.close()
        if sched_batch:  # the thread is the caller's again (an app run inside another program)
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        log.info("batchers drained, shutting down")

    app = ServiceApp(
        title="linformer-serve",
        summary="Linformer classification and translation over ONNX Runtime, with dynamic batching.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's own /docs loads Swagger UI from a CDN; ours serves it (below)
        redoc_url=None,  # ReDoc has no packaged assets here, and a page that needs the internet is worse than none
    )
    app.state.service = state  # routes reach it through service.deps.get_state; serve() sets `draining`
    app.include_router(router)
    add_offline_docs(app)
    install_error_handlers(app)
    return app
