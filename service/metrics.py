"""Prometheus metrics, one registry per app (so several apps in one process do not collide)."""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "linformer_requests", "HTTP requests by route and status code", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "linformer_request_duration_seconds", "End-to-end HTTP latency", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "linformer_queue_wait_seconds", "Time a text waited in the batcher queue", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.inference = Histogram(
            "linformer_inference_seconds", "Runtime call per batch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "linformer_batch_size", "Texts per batch", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.real_tokens = Histogram(
            "linformer_batch_real_tokens", "Non-padding tokens per batch", ["model"],
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.padded_tokens = Histogram(
            "linformer_batch_padded_tokens", "Tokens per batch including padding (batch x longest)",
            ["model"], buckets=TOKEN_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("linformer_queue_depth", "Texts waiting in the queue", ["model"], registry=r)
        self.dropped = Counter(
            "linformer_dropped_texts", "Queued texts dropped before compute", ["model", "reason"], registry=r
        )
        self.cut_ins = Counter(
            "linformer_cut_in_batches",
            "Translation batches that ran whole between two steps of a longer batch (LINFORMER_TRANSLATE_CUT_IN_RATIO)",
            ["model"], registry=r,
        )
        self.rejected = Counter(
            "linformer_rejected_requests",
            "Requests refused with 429: reason concurrency (admission, before the body is read), queue_full, or shed "
            "(queued when its route began shedding a flood, behind the requests kept)",
            ["route", "reason"], registry=r,
        )
        self.left_waiting = Counter(
            "linformer_left_waiting_requests",
            "Requests that left admission's waiting room without a slot: reason client_left (connection closed; "
            "nothing computed, logged as 499) or deadline (504)",
            ["route", "reason"], registry=r,
        )
        self.inline_inference = Counter(
            "linformer_inline_inference_seconds",
            "Runtime time spent on the event loop itself: batches of one short text with nothing queued behind it "
            "(service/batcher.py INLINE_MAX_S); every other batch runs on the model's compute thread",
            ["model"], registry=r,
        )
        self.held_refusals = Counter(
            "linformer_held_refusals",
            "Refusals at admission answered late, their connection unread meanwhile: past LINFORMER_MAX_REFUSALS_PER_S "
            "(clients resending the moment they are refused)",
            registry=r,
        )

        # (metric, label values) -> bound child: `.labels()` takes a lock and builds a key on every call
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, bound once: the per-request and per-refusal paths call this."""
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[metric, labels] = metric.labels(*labels)
        return child

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.child(self.requests, route, str(status)).inc()
        self.child(self.latency, route).observe(seconds)

    def observe_batch(
        self, model: str, *, size: int, real_tokens: int, padded_tokens: int, inference_s: float
    ) -> None:
        for metric, value in ((self.batch_size, size), (self.real_tokens, real_tokens),
                              (self.padded_tokens, padded_tokens), (self.inference, inference_s)):  # fmt: skip
            self.child(metric, model).observe(value)
