"""create_app(settings): load and verify bundles at start-up, serve them, drain the batchers at shutdown."""

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import onnxruntime as ort
import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

from service.batcher import Batcher
from service.bundle import Bundle, BundleError, load_bundle
from service.config import Settings
from service.deps import ModelService, ServiceState
from service.metrics import Metrics
from service.middleware import RequestContextMiddleware
from service.routes import router
from service.runtime import ClassifierRuntime, TranslatorRuntime, choose_providers, make_session
from service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Tests wrap the runtime (e.g. to make it slow); the wrapper must keep the wrapped runtime's `run` signature.
RuntimeWrapper = Callable[[ClassifierRuntime | TranslatorRuntime], Any]


def make_runtime(bundle: Bundle, providers: list[str], settings: Settings):
    """The bundle's ONNX sessions behind the runtime's `run`, warmed up once."""

    def session(role: str):
        return make_session(bundle.onnx_path(role), providers, intra_op_threads=settings.ort_intra_op_threads,
                            inter_op_threads=settings.ort_inter_op_threads)  # fmt: skip

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
    runtime = ClassifierRuntime(session("model"))
    runtime.run(np.full((1, 8), bundle.bos_id, dtype=np.int64), mask)
    return runtime


def load_models(
    settings: Settings, metrics: Metrics, wrap_runtime: RuntimeWrapper | None = None
) -> ServiceState:
    """Missing bundles are fine (their routes answer 503); a bundle that fails verification is not."""
    state = ServiceState(settings=settings, metrics=metrics)
    providers = choose_providers(settings.execution_provider)
    log.info(
        "execution provider: %s (requested %s; onnxruntime %s offers %s)",
        providers[0], settings.execution_provider, ort.__version__, ort.get_available_providers(),
    )
    for task, name in (("classify", settings.classify_model), ("translate", settings.translate_model)):
        path = settings.models_dir / name
        if not path.exists():
            state.unavailable[task] = (
                f"no {task} model yet: expected a bundle at {path}; export one into "
                f"{settings.models_dir}/ (or set LINFORMER_MODELS_DIR) and restart"
            )
            log.warning("%s", state.unavailable[task])
            continue
        bundle = load_bundle(path)
        if bundle.task != task:
            raise BundleError(f"bundle {path} is a {bundle.task!r} bundle, configured as the {task} model")
        tokenizer = Tokenizer.from_bundle(bundle)
        if bundle.n_max > settings.max_batch_tokens:
            log.warning("n_max=%d exceeds MAX_BATCH_TOKENS=%d: long texts run alone in oversized batches",
                        bundle.n_max, settings.max_batch_tokens)
        runtime = make_runtime(bundle, providers, settings)
        runner = wrap_runtime(runtime) if wrap_runtime else runtime
        if task == "translate":  # options = (beam_size, max_new_tokens): the batcher groups equal ones

            def run_batch(input_ids, attention_mask, options, runner=runner):
                return runner.run(input_ids, attention_mask, options)
        else:

            def run_batch(input_ids, attention_mask, _options, runner=runner):
                return runner.run(input_ids, attention_mask)

        batcher = Batcher(
            run_batch,
            name=bundle.name,
            pad_id=bundle.pad_id,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue=settings.max_queue,
            metrics=metrics,
        )
        state.models[task] = ModelService(bundle, tokenizer, batcher, execution_provider=runtime.provider)
        log.info(
            "serving %s: task=%s attention=%s n_max=%d k=%s from %s on %s",
            bundle.name, bundle.task, bundle.attention, bundle.n_max, bundle.k, path, runtime.provider,
        )
    return state


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


def create_app(settings: Settings | None = None, *, wrap_runtime: RuntimeWrapper | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            state = load_models(settings, metrics, wrap_runtime)
        except BundleError as e:
            log.error("refusing to start: %s", e)
            raise
        app.state.service = state
        batchers = [m.batcher for m in state.models.values() if m.batcher is not None]
        for batcher in batchers:
            batcher.start()
        yield
        # uvicorn has stopped accepting and waited for in-flight requests; finish anything still queued
        for batcher in batchers:
            await batcher.close()
        log.info("batchers drained, shutting down")

    app = FastAPI(
        title="linformer-serve",
        summary="Linformer classification and translation over ONNX Runtime, with dynamic batching.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's own /docs loads Swagger UI from a CDN; ours serves it (below)
        redoc_url=None,  # ReDoc has no packaged assets here, and a page that needs the internet is worse than none
    )
    app.include_router(router)
    add_offline_docs(app)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app
