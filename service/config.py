"""All service settings in one object, read once from `LINFORMER_*` environment variables."""

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# a bundle with no measured budget (translation, or exported before calibration): 32 texts of 512 tokens
UNCALIBRATED_MAX_BATCH_TOKENS = 16384


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LINFORMER_", extra="ignore")

    # where bundles live: models/<CLASSIFY_MODEL>/, models/<TRANSLATE_MODEL>/ (relative to the cwd).
    # An empty name means the task is not configured: its route answers 503 and /readyz does not wait for it.
    models_dir: Path = Path("models")
    classify_model: str = "classify-linformer"
    translate_model: str = "translate-linformer"

    # dynamic batching (policy in service/batcher.py)
    max_batch_size: int = Field(32, ge=1)
    # padded tokens in one batch: batch size x longest sequence. None: the budget measured for the bundle
    # (manifest.json `batching`, written by `python -m export calibrate`), or 16384 for a bundle without one
    max_batch_tokens: int | None = Field(None, ge=1)
    # How long the oldest queued text may wait for companions while the runtime is idle. Like Triton's
    # max_queue_delay, 0 by default: under load batches still form from the texts that queue up while
    # the previous batch computes; a positive value trades single-user latency for fuller batches.
    max_wait_ms: float = Field(0.0, ge=0)
    # texts waiting for the classifier; beyond it requests get 429
    max_queue: int = Field(256, ge=1)
    # Translation costs per generated token, so its queue is bounded by decode work, not by texts: the sum of
    # beam_size x the tokens each waiting sentence may generate (max_new_tokens, capped at the target length and at
    # twice its tokens + 16); beyond it requests get 429.
    max_queued_decode_tokens: int = Field(65536, ge=1)
    # One /translate request may ask for at most this much decode work (the same count over its sentences);
    # more -> 413 naming the limit.
    max_decode_tokens_per_request: int = Field(16384, ge=1)
    # How /translate schedules decoding (policy in service/batcher.py). "step": continuous batching, new
    # sources join the decode loop between decoder steps and finished ones answer at once; "request": a batch
    # of whole requests decodes until its last sentence ends while later arrivals wait or cut in (the behaviour before
    # step-level batching, the default until the twenty-first session). "step" is the default since it steps every
    # live row in one decoder call: on the 2-core VM, level with "request" at 1 user, 1.14-1.57x its tokens/s at 4 and
    # 16 users with a shorter p99 of all requests (but, at 16 users on the Linformer translator, a longer p99 for short
    # requests: short-first is for those), and /translate's flood goals met (README, Step-level batching;
    # benchmarks/results/step-ceiling-session21/). Before, it made 0.79-0.88x of "request"'s tokens/s at 16 users.
    translate_scheduling: Literal["step", "request"] = "step"
    # Step scheduling only: short sources first (live rows grouped by width class, trips serve the narrowest class
    # alone, the wider ones keep a bounded share; service/batcher.py WIDE_SHARE). Off: every trip steps every live
    # source, all in one decoder call per step, the throughput policy. On, short requests' p99 at 16 users was
    # ~2.2-2.6x their 1-user p99 at 0.60-0.67x request-level's tokens/s; off, see README (Step-level batching).
    translate_step_short_first: bool = False
    # Request scheduling only: a queued batch whose longest source is at most 1/ratio of the decoding batch's longest
    # runs whole between two of its steps (a cut-in, service/batcher.py), so short requests do not wait for long
    # batches to end; cut-ins take at most half of a long batch's time. 0: none, batches run one after another (the
    # most tokens/s). At 16 users, mixed lengths, 4 cut short requests' p99 2.4-2.7x at 0.77-0.87x the tokens/s
    # (README, Against CTranslate2).
    translate_cut_in_ratio: int = Field(4, ge=0)
    # deadline for an answer, counted from the request's arrival (a wait for an admission slot, the body's upload,
    # queue wait and compute all spend it): queued texts past it are not computed, and a translation batch whose
    # requests are all gone or past it stops decoding
    request_timeout_s: float = Field(30.0, gt=0)
    max_texts_per_request: int = Field(64, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1)
    # Admission control, like text-embeddings-inference's max-concurrent-requests: requests in progress per
    # task route (the burst limit: this one for /classify, /translate has its own below); a request over the limits is
    # refused before its body is parsed, so refusing costs next to nothing.
    # A stall and a flood look alike for a moment but need opposite answers: a stall of the core (another process, a
    # long batch) piles up requests that are served soon after, a flood keeps arriving faster than the model serves.
    # So a request over the burst limit waits for a slot (up to `max_waiting_requests` of them, each at most
    # `request_timeout_s`, then 504; one whose client leaves gives up its place at once) instead of being
    # refused, and only while the route is flooded (requests arrive at over twice the rate they complete, two 0.1-s
    # windows with no calm one between, service/middleware.py) are the waiting requests refused and
    # `shed_concurrent_requests` admitted, about what keeps one core's model busy, so accepted requests keep their
    # unloaded latency; the model's queue then keeps that many of the requests it holds and refuses the rest (what
    # the burst let in before the flood was recognised) (benchmarks/results/overload-*.md, soak-*.md).
    max_concurrent_requests: int = Field(128, ge=1)
    # /translate's own burst limit. The burst is what a flood gets in before it is recognised, and it is served late:
    # at ~300 short translations/s on one core (a classification of a review: ~800/s), 128 took 0.4 s, and in 3x floods
    # accepted requests' p99 was 3.4-4.1x the unloaded p99, 0.9-1.2x with 32 (benchmarks/results/
    # reliability-session19/). What a stall piles up beyond it waits in the waiting room.
    translate_max_concurrent_requests: int = Field(32, ge=1)
    max_waiting_requests: int = Field(1024, ge=0)
    shed_concurrent_requests: int = Field(16, ge=1)
    # /translate's while it sheds: a request-level batch takes every queued sentence, so with 16 in progress one batch
    # of 16 computed while new arrivals waited for it to end, and the model idled between batches; 32 lets the next
    # batch queue while one computes (3x floods: 254-358 translations/s answered with 16, 396-462 with 32).
    translate_shed_concurrent_requests: int = Field(32, ge=1)
    # Refusals (429 at admission) answered per second, all routes together; beyond it (and a burst of a tenth of a
    # second's worth) a refusal is held back, its connection unread, and answered when the rate allows. Clients that
    # resend the moment they are refused (ignoring Retry-After) then get at most this many refusals a second, not
    # as many as the event loop can write: 1,500 of them had it write ~26,000 a second at 0.85-0.95 of the core and
    # the model answer 0.05-0.15 of its unloaded throughput; 0.72-0.93 with this limit (2,000 a second: ~5-10 % of
    # one core; a 3x open-loop flood here refuses about as many) (benchmarks/results/refusal-storm/). 0: no limit.
    max_refusals_per_s: int = Field(2000, ge=0)
    # ... or this many per request the routes completed a second, if that allows more: a fixed rate held the refusals
    # of a 3x flood on a faster machine (an AMD EPYC: ~2,400 a second beside ~1,100 answers), and its clients'
    # connections with them, which put their next requests seconds late (p99 4 s, benchmarks/results/
    # reliability-session25/). A 3x flood refuses about 2 per completion; refusing costs ~1/20 of a completion's CPU.
    refusals_per_completion: float = Field(3.0, ge=0)

    # SIGTERM: /readyz turns 503 at once and answers carry `Connection: close` for this long, so load
    # balancers and keep-alive clients move away; then the server stops accepting, finishes what it
    # accepted (up to request_timeout_s more) and exits 0.
    drain_s: float = Field(5.0, ge=0)

    # gc.freeze() once the models are loaded (see service/app.py); off only to measure what it changes
    gc_freeze: bool = True
    # Linux: the event loop's thread runs as SCHED_BATCH (unprivileged), so a request arriving while a batch
    # computes no longer preempts the model's thread at once; the loop reads what arrived at the end of the
    # model's time slice or batch, several requests a wake-up, at the same fair share of the core. A 3x /classify
    # flood on one core: ~310 instead of ~820-870 loop wake-ups a second and 2-6 % more answers, closed-loop load level
    # (benchmarks/results/sched-batch-session28/). Off: SCHED_OTHER, as before.
    event_loop_sched_batch: bool = True

    # ONNX Runtime
    ort_intra_op_threads: int = Field(0, ge=0)  # 0 = ORT default (one per physical core)
    ort_inter_op_threads: int = Field(0, ge=0)
    execution_provider: Literal["auto", "cpu", "cuda"] = "auto"
    # ORT's CPU arena (and its memory patterns) keep what a run allocated for the next runs. Without it every run
    # allocates afresh, which made classify batches of 8+ 1.5-3x slower per text; kept for the life of the
    # process, one huge batch's peak stays (85 MB more after one 64-text beam-8 translation,
    # benchmarks/results/memory.md). So, false (the default): the classifier keeps its arena but hands it back
    # once it has run no batch for memory_release_s after a batch of at least ort_arena_shrink_tokens padded
    # tokens, and the translator, whose every batch is big, runs without one. true: every session keeps its
    # arena's peak.
    ort_cpu_mem_arena: bool = False
    # one text at the classify bundles' n_max (4096): normal batches (the calibrated budget) stay below it
    ort_arena_shrink_tokens: int = Field(4096, ge=1)
    # a model that ran a big batch (the classifier's above, a translation's decode buffers of 16 MB or more) gives
    # what it freed back to the OS once it has had no batch for this long, not at once: each big batch would take
    # that memory back from the OS (a 4,096-token text: ~21 ms of page faults on a ~48 ms run); a second's pause
    # costs a client sending one such text a second ~2 %
    memory_release_s: float = Field(1.0, gt=0)

    # server
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @model_validator(mode="after")
    def _one_request_fits_an_empty_queue(self) -> "Settings":
        # otherwise a request within the per-request limits would get 429 forever, with a Retry-After that lies
        if self.max_texts_per_request > self.max_queue:
            raise ValueError(f"LINFORMER_MAX_TEXTS_PER_REQUEST={self.max_texts_per_request} exceeds "
                             f"LINFORMER_MAX_QUEUE={self.max_queue}")  # fmt: skip
        if self.max_decode_tokens_per_request > self.max_queued_decode_tokens:
            raise ValueError(f"LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST={self.max_decode_tokens_per_request} exceeds "
                             f"LINFORMER_MAX_QUEUED_DECODE_TOKENS={self.max_queued_decode_tokens}")  # fmt: skip
        return self

    @property
    def task_models(self) -> dict[str, str]:
        """Task -> the bundle configured for it ("" where the task is not configured)."""
        return {"classify": self.classify_model, "translate": self.translate_model}

    def route_limits(self, task: str) -> tuple[int, int]:
        """A task route's ("classify", "translate") admission limits: requests in progress on it, normally (the
        burst limit) and while it sheds a flood (the settings ROUTE_LIMIT_SETTINGS names)."""
        burst, shed = ROUTE_LIMIT_SETTINGS[task]
        return getattr(self, burst), getattr(self, shed)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


PREFIX = Settings.model_config["env_prefix"]  # LINFORMER_
# each task route's admission settings (Settings.route_limits): its burst limit and its limit while it sheds a flood
ROUTE_LIMIT_SETTINGS = {
    "classify": ("max_concurrent_requests", "shed_concurrent_requests"),
    "translate": ("translate_max_concurrent_requests", "translate_shed_concurrent_requests"),
}


def variable(field: str) -> str:
    """The environment variable that sets this field of Settings: LINFORMER_<FIELD>."""
    return f"{PREFIX}{field.upper()}"


# LINFORMER_* variables that are not the server's: compose.yaml's replica count
NOT_SERVER_SETTINGS = frozenset({f"{PREFIX}REPLICAS"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each LINFORMER_* variable that is no setting: pydantic-settings ignores it, so a misspelt limit
    would otherwise be silently left at its default."""
    fields = [field.upper() for field in Settings.model_fields]
    warnings = []
    for variable in sorted(environ):
        name = variable.upper()  # settings are read case-insensitively
        field = name.removeprefix(PREFIX)
        if field != name and field not in fields and name not in NOT_SERVER_SETTINGS:
            close = difflib.get_close_matches(field, fields, n=1)  # (without the prefix all names share)
            warnings.append(f"{variable} is not a setting and is ignored" + (f"; did you mean {PREFIX}{close[0]}?"
                                                                             if close else ""))  # fmt: skip
    return warnings


def settings_errors(error: ValidationError, options: Mapping[str, object]) -> list[str]:
    """One line per invalid setting, naming what the operator set (the variable, or the command-line option among
    `options`) rather than pydantic's field and its documentation link."""
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        if not problem["loc"]:  # a rule across settings: its message names them
            lines.append(message)
            continue
        field = str(problem["loc"][0])
        given = f"--{field.replace('_', '-')}" if field in options else variable(field)
        lines.append(f"{given}={problem['input']!r}: {message}")
    return lines
