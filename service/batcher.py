"""The whole dynamic-batching policy: one queue per model, one batch computing at a time.

A request's texts enter the queue as separate items (already tokenised), each with its own future;
the request awaits all of them, so its results come back in order even when its texts are split
across batches. The worker forms a batch from the oldest live item plus the queued items closest to
it in length, within `max_batch_size` items and `max_batch_tokens` padded tokens (batch x longest), and,
where the bundle's calibration measured them, within the batch size that runs fastest per text at its length.
A batch is sent as soon as it is full or the runtime is free and the oldest item has waited
`max_wait_s`; while the runtime computes, new items queue and make the next batch. Items whose
request is gone (client disconnected, deadline passed) are dropped before compute, and a runtime that
works step by step (translation) stops a batch whose requests are all gone or past their deadline: it
calls `stop_if_abandoned` between steps. The queue is bounded by cost (QueueFull -> 429): each text
costs `cost` units, 1 for a classification, beam_size x the tokens it may generate for a translation, so admission
follows the work asked for rather than the request count; Retry-After is the queued cost over the
recent throughput in cost per second. A runtime error fails only its batch's requests (BatchFailed).
The runtime call runs in one compute thread per model, off the event loop, except, where `inline_max_s` is set
(classification), a lone short text: a batch of one text with nothing queued behind it, which the recent runs of lone
texts of about its length say take at most `inline_max_s`, runs on the event loop itself (`_runs_inline`); when its
request is the only one in progress and the worker idle, in `submit` itself: the worker's turn skipped, 20-35 us of
a lone request's p50 (benchmarks/results/service-bench-session32/alone/).

Cut-ins (`cut_in_ratio`, translation): while a batch decodes step by step, a queued batch whose longest text is
at most 1/`cut_in_ratio` of the decoding batch's longest may run whole between two of its steps, on the same
thread, so that a short request does not wait for a long batch to end; the long batch goes on where it stopped.
One cut-in at a time, and cut-ins take at most CUT_IN_SHARE of the time since the long batch began.

StepBatcher (at the end) keeps this request side but schedules a step-by-step runtime at every decoder step
(continuous batching): sources join and leave between steps instead of batches of whole requests.

The batcher knows nothing about the task: `run_batch(input_ids, attention_mask, options,
stop_if_abandoned)` returns one output per row. Items are only batched with items of equal `options`
(e.g. a translation request's beam size), so a translation runtime plugs in without changing this file; a
cut-in's rows may differ (they are all short), and its runtime gets a list of options, one per row.
"""

import asyncio
import bisect
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.metrics import Metrics

log = logging.getLogger(__name__)

RunBatch = Callable[[np.ndarray, np.ndarray, Hashable | list[Hashable], Callable[[], None]], Sequence[Any]]

# cut-ins may take at most this share of the time since the batch they cut into began: the long batch keeps half
CUT_IN_SHARE = 0.5

# /classify's `inline_max_s`: a batch of one text with nothing queued behind it, expected to take at most this long,
# runs on the event loop instead of the compute thread. The trip there and back (a queue, the thread's wake-up,
# `call_soon_threadsafe` and the loop's own wake-up) cost a lone short request ~20-60 us of its p50 at one connection
# (benchmarks/results/service-bench-session26/inline/); and while the loop computes a text this short, all it holds
# back is a request that would wait for the model anyway. Longer runs, and every batch while others queue, keep the
# loop free: it reads, refuses and tokenises while the model computes.
INLINE_MAX_S = 0.002


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__("the server is at capacity; retry later")


class Shed(QueueFull):
    """Queued when its route began shedding a flood, behind the requests the queue keeps (`Batcher.shed`)."""


class DeadlineExceeded(Exception):
    pass


class ShuttingDown(Exception):
    pass


class BatchFailed(Exception):
    """The runtime raised on the batch this request's texts were in (the cause is logged, not shown)."""


class BatchAbandoned(Exception):
    """Raised by `stop_if_abandoned` inside the runtime: nobody waits for this batch any more."""


class _ComputeThread:
    """The one thread a model's batches run on, off the event loop: `await call(fn, *args)` -> fn(*args).

    A plain queue and a future resolved through `call_soon_threadsafe`: a round trip costs ~18 µs of one core
    where `loop.run_in_executor` with a ThreadPoolExecutor costs ~45 µs (its concurrent Future, work item,
    thread-count check and the asyncio wrapper around the future), paid once per batch. `on_idle`, if given, runs
    on the thread each time it has had no call for `idle_s` (> 0) seconds."""

    def __init__(self, name: str, on_idle: Callable[[], None] | None = None, idle_s: float = 1.0):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._on_idle, self._idle_s = on_idle, idle_s if on_idle is not None else None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        """After the last call has been answered: the thread ends."""
        self._calls.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                try:
                    self._on_idle()  # type: ignore[misc]
                except Exception:  # the batches go on: logged, not raised into nobody
                    log.exception("%s: its idle call failed", self._thread.name)
                continue
            if call is None:
                break
            loop, future, fn, args = call
            try:
                outcome, failed = fn(*args), False
            except BaseException as error:  # handed to the awaiting coroutine, as run_in_executor would
                outcome, failed = error, True
            try:
                loop.call_soon_threadsafe(_settle, future, outcome, failed)
            except RuntimeError:  # the loop closed meanwhile: nobody awaits this any more
                pass


def _settle(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if future.done():  # its awaiter was cancelled
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _fail_unfinished(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(DeadlineExceeded())


def pad(sequences: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists -> input_ids and attention_mask (rows, longest), real tokens first."""
    if len(sequences) == 1:  # a lone text: one array, nothing to pad (512 tokens on cold caches: 52 us, not 68)
        input_ids = np.array(sequences, dtype=np.int64)
        return input_ids, np.ones_like(input_ids)
    longest = max(map(len, sequences))
    input_ids = np.full((len(sequences), longest), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


@dataclass(eq=False, slots=True)
class _Item:
    ids: list[int]
    options: Hashable
    future: asyncio.Future
    enqueued_at: float  # time.monotonic()
    deadline: float  # time.monotonic()
    request: int  # the submit it came with: a request's texts are kept or shed together
    cost: int = 1  # what it counts for against max_queue
    length: int = field(init=False)

    def __post_init__(self):
        self.length = len(self.ids)


@dataclass(slots=True)
class _Decoding:
    """The batch computing now, as far as cut-ins are concerned (event loop side)."""

    longest: int
    started: float  # time.monotonic()
    hosted_from: float  # Batcher._hosted_s when it began: the time its cut-ins took is what that grew by since
    look_again: asyncio.TimerHandle | None = None  # while their share is used up: fires when it frees


def _stop_if_abandoned(batch: list[_Item]) -> Callable[[], None]:
    def stop_if_abandoned() -> None:  # called from the compute thread; reads only futures' done flags
        now = time.monotonic()
        if all(item.future.done() or item.deadline <= now for item in batch):
            raise BatchAbandoned()

    return stop_if_abandoned


class Batcher:
    def __init__(
        self,
        run_batch: RunBatch,
        *,
        name: str,
        pad_id: int,
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_s: float,
        max_queue: int,
        metrics: Metrics | None = None,
        max_batch_size_by_length: Mapping[int, int] | None = None,
        cut_in_ratio: int = 0,
        inline_max_s: float = 0.0,
        on_idle: Callable[[], None] | None = None,
        idle_s: float = 1.0,
    ):
        """`max_queue` bounds the summed `cost` of the items waiting (texts, when every cost is 1).
        `max_batch_size_by_length` (measured length -> batch size, from the bundle's calibration) caps a batch
        further by its padded length, taken to the next measured length up (beyond the longest, its cap).
        `cut_in_ratio` (0: none): how much shorter a queued batch must be to cut in (module docstring).
        `inline_max_s` (0: never): a lone text expected to compute within it runs on the event loop (INLINE_MAX_S);
        for a runtime whose time follows the text's length (a classifier, not a decoder).
        `on_idle` runs on the compute thread whenever no batch has come to it for `idle_s` (a runtime's memory
        release: under load, never)."""
        self.run_batch = run_batch
        self.name = name
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size_by_length = dict(sorted((max_batch_size_by_length or {}).items()))
        self._measured_lengths = list(self.max_batch_size_by_length)
        self._measured_sizes = list(self.max_batch_size_by_length.values())
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: list[_Item] = []  # arrival order
        self._requests = itertools.count()  # numbers each submit's items
        self._wakeup = asyncio.Event()
        self._closing = False
        self._worker: asyncio.Task | None = None
        self._parked = False  # the worker waits for an arrival: nothing is queued or computing
        # one thread: batches of a model run one at a time, ORT's intra-op threads use the cores
        self._compute_thread = _ComputeThread(f"infer-{name}", on_idle, idle_s)
        self._queued_cost = 0
        self._cost_per_s = 0.0  # moving average of cost computed per second of compute, for Retry-After
        # lone texts' runtime seconds per token (moving average), by length class (`int.bit_length`: 8-15 tokens,
        # 16-31, ...), for `_runs_inline`; a class with no lone text measured yet has no entry
        self._lone_s_per_token: dict[int, float] = {}
        self._depth_gauge = metrics.child(metrics.queue_depth, name) if metrics else None
        self._queue_wait = metrics.child(metrics.queue_wait, name) if metrics else None
        self.cut_in_ratio = cut_in_ratio
        self.inline_max_s = inline_max_s
        self._decoding: _Decoding | None = None  # set while a batch that cut-ins may join computes
        self._cut_in: list[_Item] | None = None  # the cut-in handed over and not yet answered
        # the hand-over: the event loop appends (one batch at most), the compute thread takes it between two steps;
        # what the compute thread did not take when its batch ended, the worker computes next
        self._handover: deque[list[_Item]] = deque()
        self._hosted_s = 0.0  # time spent in cut-ins (the compute thread adds): a batch's own time leaves them out

    # ---- request side (event loop) ----

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work(), name=f"batcher-{self.name}")

    async def close(self) -> None:
        """Stop taking requests, finish every queued item, then stop the worker."""
        self._closing = True
        self._wakeup.set()
        if self._worker is not None:
            await self._worker
        self._compute_thread.close()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def submit(self, token_ids: list[list[int]], *, timeout_s: float, options: Hashable = None,
                     cost: int | list[int] = 1, alone: bool = False) -> list:  # fmt: skip
        """Queue one request's texts, each costing `cost` (or its own, one per text); return one output per text, in
        order. `alone`: the caller knows of no other request in progress (nor tokenised and on its way here), so a
        lone short text the worker would run inline (`_runs_inline`) runs at once, in this call, if the worker is idle.

        Raises QueueFull, DeadlineExceeded, ShuttingDown or BatchFailed. If the caller is cancelled (its
        client went away), its items are dropped before compute.
        """
        if self._closing:
            raise ShuttingDown()
        costs = [cost] * len(token_ids) if isinstance(cost, int) else cost
        added_cost = sum(costs)
        if self._queued_cost + added_cost > self.max_queue:
            # items whose client left still count until the worker next looks: drop them before refusing (only
            # here, not on every submit: it walks the whole queue, which under load held most requests in flight)
            self._drop_finished()
            if self._queued_cost + added_cost > self.max_queue:
                raise QueueFull(self._retry_after_s())
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        request = next(self._requests)
        items = [_Item(ids, options, loop.create_future(), now, now + timeout_s, request, c)
                 for ids, c in zip(token_ids, costs, strict=True)]  # fmt: skip
        if alone and self._parked and timeout_s > 0 and self._runs_inline(items):
            # nothing queued or computing, and no other request on its way: computed now, without the worker's turn
            if self._queue_wait is not None:
                self._queue_wait.observe(0.0)
            self._compute_inline(items)
            return [items[0].future.result()]
        self._queue.extend(items)
        self._queued_cost += added_cost
        if self._depth_gauge is not None:
            self._depth_gauge.set(len(self._queue))
        self._wakeup.set()
        if self._decoding is not None:
            self._offer_cut_in()
        futures = [item.future for item in items]
        # one timer fails whatever is unfinished at the deadline; the texts' futures are then awaited in order
        # (asyncio.wait instead cost a waiter, a set and a callback per future, 2-3x this, per request)
        deadline = loop.call_later(timeout_s, _fail_unfinished, futures)
        try:
            return [await future for future in futures]
        finally:
            deadline.cancel()
            for future in futures:  # unfinished ones are skipped by the worker; failed ones count as seen
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()

    def shed(self, keep_requests: int) -> int:
        """A flood began: its route sheds (service/middleware.py) and admits only a few requests from now on. The
        queued requests beyond the `keep_requests` oldest are refused now (Shed, a 429) instead of being served after
        the backlog of the flood's first moments, in which the route had let in its whole burst limit; the ones kept,
        and those admitted next, keep the model busy. Returns how many requests were refused."""
        self._drop_finished()
        kept: set[int] = set()
        live, refused = [], []
        for item in self._queue:
            if item.request in kept or len(kept) < keep_requests:
                kept.add(item.request)
                live.append(item)
            else:
                refused.append(item)
        if not refused:
            return 0
        self._queue = live
        self._set_depth()
        retry_after_s = self._retry_after_s()
        errors: dict[int, Shed] = {}  # one per request: an exception raised in several tasks would collect their frames
        for item in refused:
            item.future.set_exception(errors.setdefault(item.request, Shed(retry_after_s)))
        return len(errors)

    def _retry_after_s(self) -> int:
        if self._cost_per_s <= 0:
            return 1
        return max(1, math.ceil(self._queued_cost / self._cost_per_s))

    # ---- worker side (event loop; compute in the executor thread) ----

    async def _work(self) -> None:
        while True:
            if self._handover:  # handed over after the decoding batch's last step: it runs now, on its own
                self._cut_in = None
                await self._compute(self._handover.popleft())
                continue
            self._drop_finished()
            if not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                self._parked = True
                await self._wakeup.wait()
                self._parked = False
                continue
            batch, full = self._plan_batch()
            wait_left = self._queue[0].enqueued_at + self.max_wait_s - time.monotonic()
            if not full and wait_left > 0 and not self._closing:
                await self._wait_for_arrival(wait_left)
                continue
            self._take(batch)
            await self._compute(batch)

    async def _wait_for_arrival(self, seconds: float) -> None:
        """Until a new item is queued or `seconds` pass. Called with no await since the caller planned: the
        event is cleared before this first suspends, so an arrival cannot slip between planning and waiting."""
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), seconds)
        except TimeoutError:
            pass

    def _take(self, items: list[_Item]) -> None:
        """These queued items go to compute now: out of the queue, their time in it observed."""
        taken = set(map(id, items))
        self._queue = [item for item in self._queue if id(item) not in taken]
        self._set_depth()
        if self._queue_wait is not None:
            now = time.monotonic()
            for item in items:
                self._queue_wait.observe(now - item.enqueued_at)

    def _drop_finished(self) -> None:
        """Forget items nobody waits for: cancelled (client gone) or past their deadline."""
        now = time.monotonic()
        live = []
        for item in self._queue:
            if item.future.done():
                self._count_dropped("cancelled")
            elif item.deadline <= now:
                item.future.set_exception(DeadlineExceeded())
                self._count_dropped("deadline")
            else:
                live.append(item)
        if len(live) != len(self._queue):
            self._queue = live
            self._set_depth()

    def _plan_batch(self, queued: list[_Item] | None = None, any_options: bool = False) -> tuple[list[_Item], bool]:
        """The oldest item plus those closest to it in length that fit; `full` if nothing more could join.
        `queued`: the queued items to choose from (default: all); `any_options`: not only those with its options."""
        queued = self._queue if queued is None else queued
        oldest = queued[0]
        candidates = [item for item in queued[1:] if any_options or item.options == oldest.options]
        # closest in length first, older first among equals: less padding, no starvation of the oldest
        candidates.sort(key=lambda item: abs(item.length - oldest.length))
        batch, longest, full = [oldest], oldest.length, False
        limits: dict[int, int] = {}  # padded length -> its size limit, looked up once per plan
        for item in candidates:
            if len(batch) == self.max_batch_size:
                full = True
                break
            new_longest = max(longest, item.length)
            if new_longest not in limits:
                limits[new_longest] = self._batch_size_limit(new_longest)
            if len(batch) + 1 > limits[new_longest]:
                full = True  # this one would bust the token budget or its length's size; waiting cannot make it fit
                continue
            batch.append(item)
            longest = new_longest
        full = full or len(batch) >= min(self.max_batch_size, self._batch_size_limit(longest))
        return batch, full

    def _batch_size_limit(self, longest: int) -> int:
        """Rows a batch padded to `longest` may hold: the token budget's, under the measured size for its length."""
        limit = self.max_batch_tokens // longest
        if self._measured_lengths:
            at = bisect.bisect_left(self._measured_lengths, longest)
            limit = min(limit, self._measured_sizes[min(at, len(self._measured_sizes) - 1)])
        return limit

    async def _compute(self, batch: list[_Item]) -> None:
        if self._runs_inline(batch):
            self._compute_inline(batch)
            return
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        stop_if_abandoned = between_steps = _stop_if_abandoned(batch)
        if self.cut_in_ratio:
            self._decoding = _Decoding(max(item.length for item in batch), started, self._hosted_s)

            def between_steps() -> None:  # compute thread: a cut-in handed over runs here, whole
                stop_if_abandoned()
                if self._handover:
                    self._run_cut_in(self._handover.popleft(), loop)

            self._offer_cut_in()
        try:
            outcome = await self._compute_thread.call(self._pad_and_run, [item.ids for item in batch],
                                                      batch[0].options, between_steps)  # fmt: skip
        except Exception as error:
            outcome = error
        hosted_s = 0.0
        if self._decoding is not None:
            if self._decoding.look_again is not None:
                self._decoding.look_again.cancel()
            hosted_s, self._decoding = self._hosted_s - self._decoding.hosted_from, None
        self._answer_batch(batch, outcome, time.monotonic() - started - hosted_s)

    def _compute_inline(self, batch: list[_Item]) -> None:
        """A batch `_runs_inline` chose, on the event loop: answered when this returns."""
        started = time.monotonic()
        try:
            outcome = self._pad_and_run([item.ids for item in batch], batch[0].options, _stop_if_abandoned(batch))
        except Exception as error:
            outcome = error
        seconds = time.monotonic() - started
        if self.metrics:
            self.metrics.child(self.metrics.inline_inference, self.name).inc(seconds)
        self._answer_batch(batch, outcome, seconds)

    def _runs_inline(self, batch: list[_Item]) -> bool:
        """A lone text, nothing queued behind it, that lone texts of its length class computed within inline_max_s.

        Timed per length class and for lone texts only, because a lone text's run is mostly the runtime's fixed cost
        when it is short: a speed per token averaged over every batch (the first version) put too low a figure on a
        lone longer text after big batches, and let texts run on the loop for longer than inline_max_s. Within a class
        the estimate scales with the length; the first lone text of a class goes to the compute thread, unmeasured."""
        if len(batch) != 1 or self._queue:
            return False
        length = batch[0].length
        s_per_token = self._lone_s_per_token.get(length.bit_length())
        return s_per_token is not None and length * s_per_token <= self.inline_max_s

    def _answer_batch(self, batch: list[_Item], outcome: Sequence[Any] | Exception, seconds: float) -> None:
        """Event loop: a computed batch's outputs (or what stopped it) to its futures; `seconds` its own compute."""
        if isinstance(outcome, BatchAbandoned):
            log.info("model=%s batch of %d stopped: all its requests are gone or past their deadline",
                     self.name, len(batch))  # fmt: skip
            self._count_dropped("abandoned", len(batch))
            _fail_unfinished([item.future for item in batch])
            return
        if isinstance(outcome, Exception):  # a runtime failure fails this batch's requests, not the server
            log.error("model=%s batch of %d failed", self.name, len(batch), exc_info=outcome)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(BatchFailed())
            return
        if seconds > 0:
            rate = sum(item.cost for item in batch) / seconds
            self._cost_per_s = rate if self._cost_per_s == 0 else 0.8 * self._cost_per_s + 0.2 * rate
        for item, output in zip(batch, outcome, strict=True):
            if not item.future.done():
                item.future.set_result(output)

    def _offer_cut_in(self) -> None:
        """Event loop, while a batch decodes: if no cut-in is under way, the cut-ins' share of its time is not used
        up and the queue holds texts at most 1/cut_in_ratio of its longest, hand a batch of them over."""
        decoding = self._decoding
        if decoding is None or self._cut_in is not None:
            return
        hosted_s = self._hosted_s - decoding.hosted_from
        share_free_in_s = hosted_s / CUT_IN_SHARE - (time.monotonic() - decoding.started)
        if share_free_in_s > 0:
            if decoding.look_again is None:
                decoding.look_again = asyncio.get_running_loop().call_later(share_free_in_s, self._look_again)
            return
        shorter = decoding.longest // self.cut_in_ratio
        candidates = [item for item in self._queue if item.length <= shorter and not item.future.done()]
        if not candidates:
            return
        batch, _ = self._plan_batch(candidates, any_options=True)
        self._take(batch)
        self._cut_in = batch
        self._handover.append(batch)

    def _look_again(self) -> None:
        if self._decoding is not None:
            self._decoding.look_again = None
            self._offer_cut_in()

    def _run_cut_in(self, batch: list[_Item], loop: asyncio.AbstractEventLoop) -> None:
        """Compute thread, between two steps of the decoding batch: the cut-in, whole; its answer to the loop."""
        started = time.monotonic()
        try:
            options = [item.options for item in batch]
            outcome = self._pad_and_run([item.ids for item in batch], options, _stop_if_abandoned(batch))
        except Exception as error:
            outcome = error
        seconds = time.monotonic() - started
        self._hosted_s += seconds
        loop.call_soon_threadsafe(self._cut_in_done, batch, outcome, seconds)

    def _cut_in_done(self, batch: list[_Item], outcome: Sequence[Any] | Exception, seconds: float) -> None:
        self._cut_in = None
        if self.metrics:
            self.metrics.child(self.metrics.cut_ins, self.name).inc()
        self._answer_batch(batch, outcome, seconds)
        self._offer_cut_in()

    def _pad_and_run(
        self, sequences: list[list[int]], options: Hashable | list[Hashable], stop_if_abandoned: Callable[[], None]
    ) -> Sequence[Any]:
        started, hosted_before = time.perf_counter(), self._hosted_s
        input_ids, attention_mask = pad(sequences, self.pad_id)
        padded_s = time.perf_counter()
        outputs = self.run_batch(input_ids, attention_mask, options, stop_if_abandoned)
        ended = time.perf_counter() - (self._hosted_s - hosted_before)
        if self.inline_max_s and len(sequences) == 1 and (length := len(sequences[0])):  # what an inline run takes
            per_token, length_class = (ended - started) / length, length.bit_length()
            before = self._lone_s_per_token.get(length_class)
            self._lone_s_per_token[length_class] = per_token if before is None else 0.8 * before + 0.2 * per_token
        if self.metrics:
            self.metrics.observe_batch(
                self.name,
                size=len(sequences),
                real_tokens=sum(map(len, sequences)),
                padded_tokens=input_ids.size,
                inference_s=ended - padded_s,
            )
        return outputs

    def _set_depth(self) -> None:
        """After items leave the queue (submit only adds, and counts what it adds)."""
        self._queued_cost = sum(item.cost for item in self._queue)
        if self._depth_gauge is not None:
            self._depth_gauge.set(len(self._queue))

    def _count_dropped(self, reason: str, texts: int = 1) -> None:
        if self.metrics:
            self.metrics.child(self.metrics.dropped, self.name, reason).inc(texts)


class LiveDecoding(Protocol):
    """What StepBatcher drives (service/runtime.py's LiveDecode): sources named by the caller's keys."""

    rows: int  # cache rows live now (beams count)
    cache_tokens: int  # positions their caches hold (source + target so far, per row)

    widths: list[int]  # width classes with live rows, narrowest first

    def rows_for(self, options: Hashable) -> int: ...

    def width_class(self, source_length: int) -> int: ...

    def admit(self, input_ids: np.ndarray, attention_mask: np.ndarray, sources: list[tuple[Hashable, Any]]) -> None: ...

    def step(
        self, steps: int = 1, widths: Collection[int] | None = None, budget_s: float | None = None
    ) -> tuple[dict[Hashable, Any], dict[Hashable, Exception]]: ...

    def drop(self, keys: set) -> None: ...


# What one trip to the compute thread may do: each cohort served takes up to `steps` decoder steps back to back
# (stopping early, after at least one, once the trip's steps have taken `budget_s`), after encoding at most
# `encode_tokens` source tokens of arrivals (at least one source). Whatever arrives or ends during a trip waits for
# it. A call right after the same cohort's last finds its buffers in the CPU caches; after the event loop's HTTP
# work and the other cohorts' calls it ran 30-40 % slower (issue #17's profile), so bigger trips buy throughput
# with the wait of arrivals and answers.
@dataclass(frozen=True)
class TripLimits:
    steps: int
    budget_s: float
    encode_tokens: int


# Every trip steps every live cohort (the default). Issue #17's fifth round, 16 closed-loop users, fp32, development
# runs one after the other (benchmarks/results/stepthru-profile.md): 4 steps / 3 ms / 1024 tokens gave 0.71x
# request-level's tokens/s, 8 steps / 6 ms / 1024 tokens 0.83x (4.0 rows per decoder call, a trip every ~10 ms),
# short-first 0.59x. The budget counts over the trip's cohorts: the narrow ones, stepped first, take most of the 8.
THROUGHPUT_TRIPS = TripLimits(steps=8, budget_s=0.006, encode_tokens=1024)
# short_first's trips stay small: a short source waits for whatever trip is under way when it arrives.
SHORT_FIRST_TRIPS = TripLimits(steps=4, budget_s=0.001, encode_tokens=256)

# Short sources first (short_first=True, LINFORMER_TRANSLATE_STEP_SHORT_FIRST; shortest remaining work first, by
# width class: a source's max_new_tokens, and so its work, grows with its length). While more than one width class
# has work (live rows or queued sources), trips serve the narrowest class alone (its arrivals encoded, its cohort
# stepped) and the wider classes wait, except that they get a trip of their own once the narrow trips since their
# last one have taken (1 - WIDE_SHARE) / WIDE_SHARE times as long as it did. So while short work never runs out, the
# wider sources still get WIDE_SHARE of the compute thread and are never starved: a long source is slowed by short
# ones at most ~1 / WIDE_SHARE = 4 times. It gave the lowest short p99 at 16 users (2.16x and 2.62x its 1-user p99)
# and cost the most throughput (0.60x and 0.67x of request-level; 0.59x in issue #17's fifth-round counters): the
# narrowest cohort steps ~1.4 rows a call, and in a closed loop the users pile up on the starved long sources.
WIDE_SHARE = 0.25


@dataclass
class _Trip:
    widths: list[int] | None  # the width classes whose cohorts step (None: every class)
    joining: list[_Item]  # queued sources admitted first
    kind: str  # "narrow": the narrowest class while wider ones wait, "wide": theirs, "only": one class has work


class StepBatcher(Batcher):
    """Step-level (continuous) batching for a runtime that decodes token by token (translation).

    The request side is Batcher's: the same queue bounded by cost (QueueFull, Retry-After), deadlines and
    dropping of queued items whose client went away. The worker differs: instead of decoding a batch of
    whole requests until its last sentence ends, it runs decoder steps over the live sources, up to `trip_limits`
    at a time in the compute thread, and between those trips (1) drops each live source whose request is gone or
    past its deadline (the per-source form of `stop_if_abandoned`), (2) admits queued sources, oldest first,
    while the live sources stay within `max_batch_size` texts and `max_batch_tokens` cache positions (rows x
    (source + target so far): what the next steps will read), and (3) answers each source whose search ended
    during the trip. Each trip serves the width classes of sources that `_plan_trip` picks: every live class (the
    default), or with `short_first` short sources first and the wider classes at a bounded share (WIDE_SHARE), a
    class's arrivals admitted on its trips. Sources with
    any options share the steps (each keeps its own beam size and length limit); a request's beams join and
    leave together. When nothing is live, the oldest queued source may wait `max_wait_s` for companions, as in
    Batcher. A runtime error fails the sources it hit (BatchFailed), not the others. A step advances every live
    row of the classes served, one decoder call per width class, whatever the rows' target lengths (the
    runtime's cache keeps one length per row); the service gives the throughput policy a `live` without width
    classes (one class: one call per step) and short-first one with them (service/app.py).
    """

    def __init__(self, live: LiveDecoding, short_first: bool = False, **batcher_settings: Any):
        super().__init__(self._no_whole_batches, **batcher_settings)
        self.live = live
        self.short_first = short_first
        self.trip_limits = SHORT_FIRST_TRIPS if short_first else THROUGHPUT_TRIPS
        self._live_items: list[_Item] = []  # admission order
        self._cost_done = 0  # cost of the sources answered since the last throughput update
        self._busy_s = 0.0  # compute time since then
        self._narrow_s = 0.0  # compute time of narrow-only trips since the wider classes' last trip
        self._narrow_allowance_s = 0.0  # how much of it they may take before the wider classes' next trip

    @staticmethod
    def _no_whole_batches(*_args: Any) -> Sequence[Any]:
        raise NotImplementedError("StepBatcher decodes step by step through `live`, never whole batches")

    @property
    def live_depth(self) -> int:
        return len(self._live_items)

    async def _work(self) -> None:
        while True:
            self._drop_finished()
            leaving = self._leaving_live()
            if not self._queue and not self._live_items and not leaving:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._queue and not self._live_items and not self._closing:
                wait_left = self._queue[0].enqueued_at + self.max_wait_s - time.monotonic()
                if wait_left > 0 and not self._plan_admission()[1]:
                    await self._wait_for_arrival(wait_left)
                    continue
            trip = self._plan_trip()
            if trip.joining:
                self._take(trip.joining)
                self._live_items += trip.joining
            started = time.monotonic()
            try:
                finished, failed = await self._compute_thread.call(self._advance, trip.joining, leaving, trip.widths)
            except Exception as error:  # a fault outside any one decoder call: nothing live can be trusted
                finished, failed = {}, dict.fromkeys(self._live_items, error)
                self.live.drop(set(self._live_items))
            elapsed = time.monotonic() - started
            self._busy_s += elapsed
            if trip.kind == "narrow":
                self._narrow_s += elapsed
            elif trip.kind == "wide":  # the narrowest class has the next trips, for as long as WIDE_SHARE allows
                self._narrow_s, self._narrow_allowance_s = 0.0, elapsed * (1 - WIDE_SHARE) / WIDE_SHARE
            self._answer(finished, failed)

    def _plan_trip(self) -> _Trip:
        """Which width classes the next trip serves and which queued sources join them (see WIDE_SHARE)."""
        encode_tokens = self.trip_limits.encode_tokens
        classes = set(self.live.widths) | {self.live.width_class(item.length) for item in self._queue}
        if len(classes) <= 1 or not self.short_first:
            return _Trip(None, self._plan_admission(None, encode_tokens)[0], "only")
        narrowest = min(classes)
        if self._narrow_s < self._narrow_allowance_s:
            joining, _ = self._plan_admission([narrowest], encode_tokens)
            if joining or narrowest in self.live.widths:  # else its arrivals wait for room the wider ones free
                return _Trip([narrowest], joining, "narrow")
        wider = sorted(classes - {narrowest})
        return _Trip(wider, self._plan_admission(wider, encode_tokens)[0], "wide")

    def _leaving_live(self) -> set:
        """Live sources nobody waits for any more: their client went away or their deadline passed."""
        now = time.monotonic()
        leaving = set()
        for item in self._live_items:
            if item.future.done():
                leaving.add(item)
            elif item.deadline <= now:
                item.future.set_exception(DeadlineExceeded())
                leaving.add(item)
        if leaving:
            self._live_items = [item for item in self._live_items if item not in leaving]
            self._count_dropped("abandoned", len(leaving))
        return leaving

    def _plan_admission(
        self, widths: Collection[int] | None = None, max_source_tokens: int | None = None
    ) -> tuple[list[_Item], bool]:
        """The oldest queued sources (of these width classes; None: any) that fit beside the live ones; `full` if
        the next one does not fit.

        Arrival order within the classes, no skipping: a big source at the head waits for room rather than being
        overtaken forever. A source that fits nothing (longer than the whole budget) still runs when nothing else
        is live.
        """
        texts, rows, tokens = len(self._live_items), self.live.rows, self.live.cache_tokens
        joining: list[_Item] = []
        joining_rows, longest, source_tokens = 0, 0, 0
        for item in self._queue:
            if widths is not None and self.live.width_class(item.length) not in widths:
                continue
            if texts + len(joining) == self.max_batch_size:
                return joining, True
            if max_source_tokens is not None and joining and source_tokens + item.length > max_source_tokens:
                return joining, True
            source_tokens += item.length
            item_rows = self.live.rows_for(item.options)
            new_longest = max(longest, item.length)
            # the joining rows' cross keys are padded to their longest source; one self-attention position each
            cohort_tokens = (joining_rows + item_rows) * (new_longest + 1)
            if tokens + cohort_tokens > self.max_batch_tokens and (rows or joining):
                return joining, True
            joining.append(item)
            joining_rows, longest = joining_rows + item_rows, new_longest
        return joining, False

    def _advance(self, joining: list[_Item], leaving: set, widths: list[int] | None) -> tuple[dict, dict]:
        """Compute thread: the leaving sources go, the joining ones are encoded, then up to `trip_limits.steps` steps
        of the cohorts of `widths` (None: all; see the class)."""
        if leaving:
            self.live.drop(leaving)
        failed: dict[Hashable, Exception] = {}
        if joining:
            started = time.perf_counter()
            sequences = [item.ids for item in joining]
            try:
                self.live.admit(*pad(sequences, self.pad_id), [(item, item.options) for item in joining])
            except Exception as error:  # the encoder failed on these sources: only they fail
                failed.update((item, error) for item in joining)
            if self.metrics:
                self.metrics.observe_batch(
                    self.name, size=len(joining), real_tokens=sum(map(len, sequences)),
                    padded_tokens=len(joining) * max(map(len, sequences)), inference_s=time.perf_counter() - started,
                )  # fmt: skip
        if not self.live.rows:
            return {}, failed
        limits = self.trip_limits
        finished, step_failed = self.live.step(limits.steps, widths, limits.budget_s)
        return finished, failed | step_failed

    def _answer(self, finished: dict, failed: dict) -> None:
        if failed:
            log.error("model=%s decoding failed for %d source(s)", self.name, len(failed),
                      exc_info=next(iter(failed.values())))  # fmt: skip
        gone = set(finished) | set(failed)
        if not gone:
            return
        self._live_items = [item for item in self._live_items if item not in gone]
        for item, output in finished.items():
            self._cost_done += item.cost
            if not item.future.done():
                item.future.set_result(output)
        for item in failed:
            if not item.future.done():
                item.future.set_exception(BatchFailed())
        if finished and self._busy_s > 0:
            rate = self._cost_done / self._busy_s
            self._cost_per_s = rate if self._cost_per_s == 0 else 0.8 * self._cost_per_s + 0.2 * rate
            self._cost_done, self._busy_s = 0, 0.0
