"""ONNX Runtime behind the one call the batcher makes: padded int64 ids + mask in, one row per text out."""

import ctypes
import ctypes.util
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# A decode whose buffers reached this size leaves `_return_freed_memory` to the runtime's `release_memory` (a small
# one's pages are reused by the next; trimming them costs ~0.2 ms per request plus the page faults of taking them
# back, 5-10 % of a single-stream sentence; trimmed after each big decode, a single stream of four-paragraph beam-4
# requests spent about twice the system time of a trim that waits for the model to idle)
BIG_DECODE_BYTES = 16 << 20
# Decode buffers up to this size outlive their last source, for the next one (TranslatorRuntime.take_spare). New
# ones cost each sentence their IO binding (~20 bind calls, ~0.17 ms, about half a decoder step at batch 1) and
# the arrays' set-up: with spares a single stream decodes 3-4 % more tokens per CPU second (two runs of
# `benchmarks/ctranslate2_decode.py --new-buffers`, README)
SPARE_DECODE_BYTES = 4 << 20

# GroupQueryAttention over a cache buffer bound as both past and present, with rows of different lengths in one
# batch: onnxruntime 1.20.1 loads the step-form decoder but decodes batches wrongly (9 of 200 test sentences
# identical to 1.32's greedy output, the rest run on); 1.21.0 and later give 200 of 200
STEP_DECODER_MIN_ORT = (1, 21)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _load_malloc_trim():
    libc_name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(libc_name).malloc_trim if libc_name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


_malloc_trim = _load_malloc_trim()


def _return_freed_memory() -> None:
    """glibc keeps the pages a big batch freed for reuse, so an idle server stays at its peak (64 MB kept after
    one 64-text beam-8 translation with ORT's arena off: benchmarks/results/memory.md); give them back."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _gpu_present() -> bool:
    # onnxruntime-gpu lists CUDA even on machines without a GPU, and then logs a page of library-load
    # errors per session; a device node is a cheap, quiet check first (/dev/dxg is a GPU under WSL).
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "dxg").exists()


def choose_providers(preference: str) -> list[str]:
    """Pick the execution providers once, at start-up: 'auto' takes CUDA only where it can work."""
    available = ort.get_available_providers()
    if preference == "cpu":
        return [CPU]
    if preference == "cuda":
        if CUDA not in available:
            raise RuntimeError(
                f"EXECUTION_PROVIDER=cuda but this onnxruntime offers only {available}; "
                "install onnxruntime-gpu (pip install '.[gpu]')"
            )
        return [CUDA, CPU]
    return [CUDA, CPU] if CUDA in available and _gpu_present() else [CPU]


def make_session(
    model_path: Path, providers: list[str], *, intra_op_threads: int = 0, inter_op_threads: int = 0,
    cpu_mem_arena: bool = True,
) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.enable_cpu_mem_arena = cpu_mem_arena
    # memory patterns pre-plan and cache one block per input shape seen, which the arena-off setting is
    # meant to avoid keeping; they go with the arena
    options.enable_mem_pattern = cpu_mem_arena
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: warnings about unused initializers are noise here
    return ort.InferenceSession(str(model_path), sess_options=options, providers=providers)


class ClassifierRuntime:
    """model.onnx: input_ids, attention_mask int64 [batch, seq] -> logits float32 [batch, num_labels].

    `shrink_from_tokens`: once a batch of at least this many padded tokens has run, `release_memory` hands the
    memory it took back to the OS: ORT's arena frees its unused regions (the run option below, on a one-text run)
    and glibc its freed pages. The batcher's compute thread calls it whenever it has had no batch for a while
    (LINFORMER_MEMORY_RELEASE_S), not after each big batch: taking the memory back costs the next big batch its
    page faults (a 4,096-token text: ~13-21 ms of kernel time on a ~48 ms run, 0.64-0.76 of the model's rate when every
    run shrank). Smaller batches keep what they used in the arena, so the next batch of that size allocates nothing.
    None: never."""

    def __init__(self, session: ort.InferenceSession, *, shrink_from_tokens: int | None = None):
        self.session = session
        outputs = [o.name for o in session.get_outputs()]
        self._output = "logits" if "logits" in outputs else outputs[0]
        self.shrink_from_tokens = shrink_from_tokens
        self._shrink: ort.RunOptions | None = None  # ORT refuses the option for a session without an arena
        if session.get_session_options().enable_cpu_mem_arena:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.holding = False  # a big batch ran since the last release
        # one run at a time: the release's run comes from the compute thread, a lone short text's from the event loop
        self._lock = threading.Lock()

    @property
    def provider(self) -> str:
        return self.session.get_providers()[0]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        with self._lock:
            logits = self.session.run([self._output], feeds)[0]
            if self.shrink_from_tokens is not None and input_ids.size >= self.shrink_from_tokens:
                self.holding = True
        return logits

    def release_memory(self) -> None:
        """If a big batch ran since the last call, give its memory back (a one-text run with the arena's shrink
        option, then glibc's trim); else nothing."""
        with self._lock:
            if not self.holding:
                return
            if self._shrink is not None:
                one = np.zeros((1, 8), dtype=np.int64)
                self.session.run([self._output], {"input_ids": one, "attention_mask": np.ones_like(one)}, self._shrink)
            self.holding = False
        _return_freed_memory()


def bind_array(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False,
               shape: list[int] | None = None) -> None:  # fmt: skip
    """Bind a CPU array in place (no copy) as the input, or output, `name`, as `shape` (a view of its first rows; None:
    its own shape): keep the array alive while bound."""
    (binding.bind_output if output else binding.bind_input)(name, "cpu", 0, array.dtype, shape or list(array.shape),
                                                            array.ctypes.data)  # fmt: skip


def probabilities(logits: np.ndarray) -> list[list[float]]:
    """Softmax per row, as Python floats: done once per batch here, not once per text in the event loop. In float64
    with `math`, not numpy: a row holds one logit per label (two), where numpy's five calls cost 16 us of a lone
    text's path right after its session.run (caches cold) against 4 us for this
    (benchmarks/results/service-bench-session31/)."""
    rows = []
    for row in logits.tolist():
        top = max(row)
        exps = [math.exp(logit - top) for logit in row]
        total = sum(exps)
        rows.append([e / total for e in exps])
    return rows


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# A translation ends after at most 2 x its source's tokens + 16 (fairseq's max_len_a / max_len_b): no reference of
# the held-out or dev splits is longer (1 of 2,250 test pairs, a misaligned one), and a decoder that loops stops
# there instead of at tgt_n_max. It also makes a short sentence's decode budget its own size (service/routes.py).
MAX_LEN_A, MAX_LEN_B = 2, 16


def new_tokens_limit(source_tokens: int, max_new_tokens: int, tgt_n_max: int) -> int:
    """The most tokens a source of this many tokens (EOS included) may generate."""
    return min(max_new_tokens, tgt_n_max, MAX_LEN_A * source_tokens + MAX_LEN_B)


def _length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp = ((5 + len) / 6) ** alpha; len counts EOS."""
    return ((5 + length) / 6) ** alpha


class TranslatorRuntime:
    """encoder.onnx once per source, then decoder.onnx (the step form, export/step_decoder.py) one token at a time.

    `run(input_ids, attention_mask, (beam_size, max_new_tokens), between_steps)` -> one list of target token
    ids per row (no BOS/EOS): a batch of whole requests decoded until its last sentence ends (options for every
    row, or a list of them, one per row: each row keeps its own beam and length limit, max_new_tokens capped by
    `new_tokens_limit`: the target length and twice the row's source tokens + 16). `between_steps`
    is called before each decoder step; it raises to stop the batch (the batcher's does when nobody waits for
    the answers any more). `live()` gives the step-level form of the same decoding: a `LiveDecode` that sources
    join and leave between steps (service/batcher.py's StepBatcher decides who and when). The searches are the
    same as training/decode.py (greedy; beam search with GNMT length penalty, fairseq's finishing rule).
    """

    def __init__(
        self,
        encoder: ort.InferenceSession,
        decoder: ort.InferenceSession,
        *,
        n_layers: int,
        n_heads: int,
        head_dim: int,
        tgt_n_max: int,
        bos_id: int,
        eos_id: int,
        length_penalty_alpha: float = 0.6,
    ):
        inputs = {i.name for i in decoder.get_inputs()}
        if "past_lengths" not in inputs or "cross_lengths" not in inputs:
            form = "not the step form (no past_lengths input)" if "past_lengths" not in inputs else (
                "the earlier step form (cross-attention over cross_mask, not cross_lengths)")
            raise ValueError(f"decoder.onnx is {form}: convert the bundle with `python -m export step-decoder "
                             "--bundle <bundle>` (an int8 bundle: its fp32 bundle, then quantise again)")  # fmt: skip
        if _release(ort.__version__) < STEP_DECODER_MIN_ORT:
            raise ValueError(f"the step-form decoder needs onnxruntime >= {'.'.join(map(str, STEP_DECODER_MIN_ORT))}, "
                             f"this is {ort.__version__}")  # fmt: skip
        self.encoder, self.decoder = encoder, decoder
        self.n_heads, self.head_dim, self.tgt_n_max = n_heads, head_dim, tgt_n_max
        self.bos_id, self.eos_id, self.alpha = bos_id, eos_id, length_penalty_alpha
        kinds = [(i, kind) for i in range(n_layers) for kind in ("key", "value")]
        self.past_names = [f"past_{kind}_{i}" for i, kind in kinds]
        self.present_names = [f"present_{kind}_{i}" for i, kind in kinds]
        self.cross_names = [f"cross_{kind}_{i}" for i, kind in kinds] + ["cross_mask"]  # the encoder's outputs
        self.cross_last_names = [f"cross_last_{kind}_{i}" for i, kind in kinds]
        self.vocab_size = decoder.get_outputs()[0].shape[-1]
        self._spare: _DecodeBuffers | None = None  # left by the last decode (SPARE_DECODE_BYTES)
        self.holding = False  # a big decode ended since the last release: its freed pages are still the process's

    @property
    def provider(self) -> str:
        return self.decoder.get_providers()[0]

    def live(self, width_classes: bool = True) -> "LiveDecode":
        return LiveDecode(self, width_classes)

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, options,
        between_steps: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        between_steps = between_steps or (lambda: None)
        live = LiveDecode(self)
        sources = set(range(len(input_ids)))
        per_row = options if isinstance(options, list) else [options] * len(input_ids)
        try:
            live.admit(input_ids, attention_mask, list(enumerate(per_row)))
            outputs: dict[Hashable, list[int]] = {}
            while live.rows:
                between_steps()
                finished, failed = live.step()
                for error in failed.values():
                    raise error
                outputs.update(finished)
            return [outputs[row] for row in range(len(input_ids))]
        finally:  # an abandoned or failed batch's rows leave too (LiveDecode notes big buffers for release_memory)
            live.drop(sources)

    def release_memory(self) -> None:
        """If a big decode ended since the last call, give the heap pages it freed back to the OS (the batcher's
        compute thread calls it once the model idles, on the thread that decodes)."""
        if self.holding:
            self.holding = False
            _return_freed_memory()

    def take_spare(self, rows: int, memory: int) -> "_DecodeBuffers | None":
        """The buffers a decode left (`keep_spare`), if they hold `rows` rows and `memory` cross positions but not
        twice that many (the width _Cohort._compact narrows from); whoever takes them owns them."""
        spare = self._spare
        if spare is None or rows > spare.capacity or not spare.memory // 2 <= memory <= spare.memory:
            return None
        self._spare = None
        return spare

    def keep_spare(self, buffers: "_DecodeBuffers") -> None:
        """Buffers nobody decodes in any more: kept for the next decode if small, replacing the last ones kept."""
        if buffers.nbytes <= SPARE_DECODE_BYTES:
            buffers.rows = 0
            self._spare = buffers

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
        """Padded sources -> cross keys/values per decoder layer (rows, H, S', hd) and cross_mask (rows, S')."""
        return self.encoder.run(self.cross_names, {"input_ids": input_ids, "attention_mask": attention_mask})


# sources whose search ended -> their target tokens; sources whose decoder call raised -> the error
StepOutcome = tuple[dict[Hashable, list[int]], dict[Hashable, Exception]]


class _Search:
    """One source's search: greedy (beam 1) or beam search over its `beam` rows of the decode buffers."""

    def __init__(self, key: Hashable, beam: int, max_new_tokens: int, eos_id: int, alpha: float):
        self.key, self.beam, self.max_new_tokens, self.eos_id, self.alpha = key, beam, max_new_tokens, eos_id, alpha
        self.scores = np.zeros((1, beam), np.float32)
        self.scores[:, 1:] = -np.inf  # all beams start as the same BOS: only the first may expand
        self.generated: list[int] = []  # greedy: the tokens so far
        self.history = np.zeros((beam, 0), dtype=np.int64)  # beam search: tokens of each row so far
        self.finished: list[tuple[float, list[int]]] = []
        self.output: list[int] | None = None  # set when the search ends
        self.rows = np.arange(beam)  # its rows in the decode buffers (LiveDecode sets and moves them)

    def advance_greedy(self, token: int, step: int) -> tuple[list[int], list[int]]:
        """Beam 1: the row's best next token at `step` -> ([0], [token]), or ([], []) once the search has ended."""
        if token != self.eos_id:
            self.generated.append(token)
        if token == self.eos_id or step == self.max_new_tokens - 1:
            self.output = self.generated
            return [], []
        return [0], [token]

    def advance(self, log_probs: np.ndarray, step: int) -> tuple[list[int], list[int]]:
        """Beam search (beam > 1; beam 1 is `advance_greedy`): this source's rows' next-token log-probabilities
        (beam, V) at `step` -> (rows to keep, their next tokens), both empty once the search has ended (then
        `output` holds the result)."""
        at_limit = step == self.max_new_tokens - 1
        beam, vocab = self.beam, log_probs.shape[-1]
        candidates = (self.scores[:, :, None] + log_probs.reshape(1, beam, vocab)).reshape(1, -1)
        top = np.argpartition(-candidates, 2 * beam, axis=1)[:, : 2 * beam]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(candidates, top, 1), 1, kind="stable"), 1)
        chosen = []
        for rank, index in enumerate(top[0].tolist()):
            score = float(candidates[0, index])
            row, token = divmod(index, vocab)
            if token == self.eos_id:
                if rank < beam:
                    self.finished.append((score / _length_penalty(step + 1, self.alpha), self.history[row].tolist()))
            elif len(chosen) < beam:
                chosen.append((row, token, score))
        if at_limit:  # out of length: the live beams end here, as they are
            for row, token, score in chosen:
                hypothesis = self.history[row].tolist() + [token]
                self.finished.append((score / _length_penalty(step + 1, self.alpha), hypothesis))
        if len(self.finished) >= beam or at_limit:
            self.output = max(self.finished, key=lambda h: h[0])[1]
            return [], []
        rows = [row for row, _, _ in chosen]
        tokens = [token for _, token, _ in chosen]
        self.history = np.concatenate([self.history[rows], np.array(tokens, dtype=np.int64)[:, None]], axis=1)
        self.scores = np.array([[score for _, _, score in chosen]], np.float32)
        return rows, tokens


class _DecodeBuffers:
    """Every live row's decoder state in preallocated arrays, bound to the decoder once (IO binding) and updated
    in place, so a step passes no arrays through Python and copies nothing but the new key/value column.

    Row r of each array is one live row (rows 0..rows-1 in use, any order). The self-attention cache is
    (rows, H, tgt_n_max, hd) per layer: bound as both `past_*` and `present_*`, the decoder's attention kernel
    writes the new column at position `lengths[r]` in place and attends over that row's own positions only, so
    rows of any lengths share one call. The cross keys/values are (rows, H, memory, hd) with `memory` at least the
    longest live source's, bound the same way: the kernel attends over row r's first `source_lengths[r]` positions
    only (writing the row's last source key/value, `cross_last`, over itself), so a short source does not pay for a
    long one's width. Capacities grow by doubling; a binding is made once per number of live rows and kept with the
    arrays, not renewed per step.
    """

    def __init__(self, runtime: TranslatorRuntime, capacity: int, memory: int, old: "_DecodeBuffers | None" = None):
        rt = self.runtime = runtime
        self.capacity, self.memory = capacity, memory
        heads, head_dim = rt.n_heads, rt.head_dim
        self.cache = {name: np.empty((capacity, heads, rt.tgt_n_max, head_dim), np.float32) for name in rt.past_names}
        self.cross = {name: np.zeros((capacity, heads, memory, head_dim), np.float32) for name in rt.cross_names[:-1]}
        self.cross_last = {name: np.zeros((capacity, 1, heads * head_dim), np.float32) for name in rt.cross_last_names}
        self.tokens = np.zeros((capacity, 1), np.int64)
        self.lengths = np.zeros(capacity, np.int32)  # target tokens cached per row = the next token's position
        self.source_lengths = np.zeros(capacity, np.int32)  # cross positions per row (`cross_lengths`)
        self.total_length = np.zeros(1, np.int32)
        self.cross_total = np.zeros(1, np.int32)
        self.logits = np.empty((capacity, rt.vocab_size), np.float32)
        self.rows = 0
        self.bindings: dict[int, ort.IOBinding] = {}  # live rows -> the binding of their views
        if old is not None:  # carry the live rows over
            n, shared = old.rows, min(memory, old.memory)
            for name in self.cache:
                self.cache[name][:n] = old.cache[name][:n]
            for name in self.cross:
                self.cross[name][:n, :, :shared] = old.cross[name][:n, :, :shared]
            for mine, theirs in ((self.tokens, old.tokens), (self.lengths, old.lengths),
                                 (self.source_lengths, old.source_lengths),
                                 *zip(self.cross_last.values(), old.cross_last.values(), strict=True)):  # fmt: skip
                mine[:n] = theirs[:n]
            self.rows = n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.cache.values(), *self.cross.values(), self.logits))

    def bind(self) -> ort.IOBinding:
        """The decoder's inputs and outputs as views of the first `rows` rows (no copies)."""
        if (binding := self.bindings.get(self.rows)) is not None:
            return binding
        n, binding = self.rows, self.runtime.decoder.io_binding()

        def put(name: str, array: np.ndarray, output: bool = False) -> None:
            whole = array is self.total_length or array is self.cross_total
            bind_array(binding, name, array, output, shape=None if whole else [n, *array.shape[1:]])

        put("input_ids", self.tokens)
        put("past_lengths", self.lengths)
        put("total_length", self.total_length)
        put("cross_lengths", self.source_lengths)
        put("cross_total", self.cross_total)
        for name, array in self.cross.items():
            put(name, array)
            put(f"present_{name}", array, output=True)  # the same buffer: the kernel writes each last key over itself
        for name, array in self.cross_last.items():
            put(name, array)
        for past, present in zip(self.runtime.past_names, self.runtime.present_names, strict=True):
            put(past, self.cache[past])
            put(present, self.cache[past], output=True)  # the same buffer: the kernel appends in place
        put("logits", self.logits, output=True)
        self.bindings[n] = binding
        return binding

    def run(self) -> np.ndarray:
        """One decoder call for every live row -> next-token logits (rows, V), a view valid until the next call."""
        self.total_length[0] = self.lengths[: self.rows].max() + 1
        self.cross_total[0] = self.source_lengths[: self.rows].max()
        self.runtime.decoder.run_with_iobinding(self.bind())
        return self.logits[: self.rows]

    def write_sources(self, start: int, cross: list[np.ndarray], source_lengths: np.ndarray) -> None:
        """Rows start.. start+len get these sources' cross keys/values (already repeated per beam; each row's
        `source_lengths` positions, the rest padding), an empty self-attention cache and BOS."""
        end = start + len(source_lengths)
        width = cross[0].shape[2]
        rows, last = np.arange(len(source_lengths)), source_lengths - 1
        for name, last_name, array in zip(self.runtime.cross_names[:-1], self.runtime.cross_last_names, cross[:-1],
                                          strict=True):  # fmt: skip
            self.cross[name][start:end, :, :width] = array
            self.cross_last[last_name][start:end, 0] = array[rows, :, last].reshape(len(rows), -1)
        self.tokens[start:end] = self.runtime.bos_id
        self.lengths[start:end] = 0
        self.source_lengths[start:end] = source_lengths
        self.rows = max(self.rows, end)

    def copy_rows(self, targets: np.ndarray, sources: np.ndarray, positions: int) -> None:
        """Rows `targets` become copies of rows `sources` (their first `positions` cached tokens, their sources'
        cross keys, token and lengths); the right-hand side is read before anything is written."""
        for array in self.cache.values():
            array[targets, :, :positions] = array[sources, :, :positions]
        width = int(self.source_lengths[sources].max())  # the decoder reads no cross position past a row's own
        for array in self.cross.values():
            array[targets, :, :width] = array[sources, :, :width]
        for array in (*self.cross_last.values(), self.tokens, self.lengths, self.source_lengths):
            array[targets] = array[sources]


class _Cohort:
    """The live rows of one width class (see LiveDecode): their searches and their _DecodeBuffers, one decoder
    call per step. Rows leave by compaction; once nobody is live its buffers go (to the runtime, if small)."""

    def __init__(self, runtime: TranslatorRuntime):
        self.runtime = runtime
        self.searches: list[_Search] = []
        self.buffers: _DecodeBuffers | None = None

    @property
    def rows(self) -> int:
        return self.buffers.rows if self.buffers else 0

    @property
    def cache_tokens(self) -> int:
        if not self.buffers:
            return 0
        b = self.buffers
        return int(b.source_lengths[: b.rows].sum() + b.lengths[: b.rows].sum())

    def add(self, cross: list[np.ndarray], sources: list[tuple[Hashable, Any]], source_tokens: list[int]) -> None:
        """These sources' cross keys/values and cross_mask (one row per source) join as new rows, one per beam."""
        rt = self.runtime
        beams = np.array([LiveDecode.rows_for(options) for _, options in sources])
        if (beams != 1).any():
            cross = [np.repeat(t, beams, axis=0) for t in cross]
        start, memory = self.rows, cross[0].shape[2]
        self._make_room(start + int(beams.sum()), memory)
        mask = cross[-1]
        if not (np.logical_and.accumulate(mask, axis=1) == mask).all():  # cross_lengths would misread it
            raise ValueError("the encoder's cross_mask is not a prefix of each row (sources padded on the right)")
        self.buffers.write_sources(start, cross, mask.sum(axis=1, dtype=np.int32))
        for (key, (beam, max_new_tokens)), tokens in zip(sources, source_tokens, strict=True):
            search = _Search(key, beam, new_tokens_limit(tokens, max_new_tokens, rt.tgt_n_max), rt.eos_id, rt.alpha)
            search.rows = np.arange(start, start + beam)
            start += beam
            self.searches.append(search)

    def _make_room(self, rows: int, memory: int) -> None:
        """Buffers that hold `rows` rows and `memory` cross positions, the live rows carried over."""
        b = self.buffers
        if b is not None and rows <= b.capacity and memory <= b.memory:
            return
        if b is None and (spare := self.runtime.take_spare(rows, _round_memory(memory))) is not None:
            self.buffers = spare
            return
        capacity = rows if b is None else max(rows, 2 * b.capacity)  # a whole batch's rows come in one admit
        if b is not None and rows <= b.capacity:
            capacity = b.capacity
        memory = _round_memory(max(memory, b.memory if b else 0))
        self.buffers = _DecodeBuffers(self.runtime, capacity, memory, old=b)

    def step(self) -> StepOutcome:
        """One decoder call for every row of the cohort (see LiveDecode.step)."""
        finished: dict[Hashable, list[int]] = {}
        if not self.searches:
            return finished, {}
        b = self.buffers
        try:
            logits = b.run()
        except Exception as error:  # one call for the cohort: every source in it fails with it
            failed = {search.key: error for search in self.searches}
            self.searches = []
            self._compact()
            return finished, failed
        best = logits.argmax(axis=1).tolist()  # every row's best next token (the greedy sources'), in one pass
        lengths = b.lengths[: b.rows].tolist()  # tokens decoded so far (this step's was cached at this position)
        going: list[_Search] = []
        greedy_rows: list[int] = []  # the greedy sources going on: their rows take their tokens in one write
        for search in self.searches:
            rows = search.rows
            row = int(rows[0])
            if search.beam == 1:
                kept, tokens = search.advance_greedy(best[row], lengths[row])
            else:
                kept, tokens = search.advance(_log_softmax(logits[rows]), lengths[row])
            if search.output is not None:
                finished[search.key] = search.output
                continue
            going.append(search)
            if search.beam == 1:
                greedy_rows.append(row)
                continue
            if kept != list(range(search.beam)):  # beams reordered: each takes its parent's cache
                b.copy_rows(rows, rows[kept], lengths[row] + 1)
            b.tokens[rows, 0] = tokens
            b.lengths[rows] = lengths[row] + 1
        if greedy_rows:
            b.tokens[greedy_rows, 0] = [best[row] for row in greedy_rows]
            b.lengths[greedy_rows] += 1
        if len(going) != len(self.searches):
            self.searches = going
            self._compact()
        return finished, {}

    def _compact(self) -> None:
        """After sources left: the live rows move into rows 0..n-1 (the last ones into the holes), the cross
        buffer narrows when its longest sources have gone, and once nobody is live the buffers go (kept by the
        runtime for the next decode if small)."""
        if not self.searches:
            self.runtime.keep_spare(self.buffers)
            self.buffers = None
            return
        b = self.buffers
        live = np.concatenate([search.rows for search in self.searches])
        n = len(live)
        movers = live[live >= n]
        if len(movers):
            holes = np.setdiff1d(np.arange(n), live)
            b.copy_rows(holes, movers, int(b.lengths[movers].max()))
            moved = dict(zip(movers.tolist(), holes.tolist(), strict=True))
            for search in self.searches:
                search.rows = np.array([moved.get(row, row) for row in search.rows.tolist()])
        b.rows = n
        memory = _round_memory(int(b.source_lengths[:n].max()))
        if memory < b.memory // 2:  # the long sources left: buffers (and each row copy) shrink to the rest's width
            self.buffers = _DecodeBuffers(self.runtime, b.capacity, memory, old=b)

    def drop(self, keys: set) -> None:
        going = [search for search in self.searches if search.key not in keys]
        if len(going) != len(self.searches):
            self.searches = going
            self._compact()


class LiveDecode:
    """The sources being decoded, step by step: they join (`admit`), advance one token per `step` and leave
    when their search ends (returned by `step`) or when told to (`drop`). Sources are named by keys the caller
    chooses. Mechanics only: who joins, when, and which width classes step is the caller's policy. Not thread-safe:
    one thread drives it.

    Live rows decode in cohorts, one decoder call per cohort per step; within a cohort, rows of any target length
    and any source length share the call, each attending over its own (_DecodeBuffers). With `width_classes`, rows
    are grouped by source width (sources of up to 64, 128, 256, ... tokens), each class encoded and stepped on its
    own: what `run` (request-level batches) and short-first step scheduling use, the latter to step short sources
    without the long ones. Without, every live row is in one cohort: step-level batching's throughput policy. Under
    the load's mix (8-256 tokens) the long sources make up most of the live rows (they live longest), so the narrow
    classes' calls carried 1-2 rows each, at nearly the fixed cost of a call (~0.5 ms on the 2-core VM). At full
    occupancy one cohort made 1.6-1.8x the width classes' tokens/s, 1.33x / 1.56x request-level's (transformer /
    linformer), when every row still paid for the widest source's cross-attention (benchmarks/step_ceiling.py,
    benchmarks/results/step-ceiling-session21/), and 1.65x / 1.67x request-level's since each row pays for its own
    (benchmarks/results/ragged-cross-session22/).
    """

    def __init__(self, runtime: TranslatorRuntime, width_classes: bool = True):
        """When the last source leaves after buffers of BIG_DECODE_BYTES or more, the runtime holds freed heap pages
        that `release_memory` gives back to the OS once the model idles, so a burst does not leave the process at its
        peak (one batch of `run`, or a long-lived decode loop)."""
        self.runtime = runtime
        self.width_classes = width_classes
        self.cohorts: dict[int, _Cohort] = {}  # width class -> its rows, narrowest first
        self.peak_bytes = 0  # the largest buffers held since the last trim

    @staticmethod
    def rows_for(options) -> int:
        """Cache rows a source with these options takes: one per beam."""
        beam_size, _ = options
        return beam_size

    def width_class(self, source_length: int) -> int:
        """The cohort a source of this many tokens decodes in: `width_class` of it, or 0 (the one cohort) without
        width classes."""
        return width_class(source_length) if self.width_classes else 0

    @property
    def rows(self) -> int:
        return sum(cohort.rows for cohort in self.cohorts.values())

    @property
    def cache_tokens(self) -> int:
        """Positions the live rows read per step: their source's cross keys and their target so far."""
        return sum(cohort.cache_tokens for cohort in self.cohorts.values())

    @property
    def searches(self) -> list[_Search]:
        return [search for cohort in self.cohorts.values() for search in cohort.searches]

    @property
    def widths(self) -> list[int]:
        """The width classes that have live rows, narrowest first."""
        return [width for width, cohort in self.cohorts.items() if cohort.searches]

    def admit(self, input_ids: np.ndarray, attention_mask: np.ndarray, sources: list[tuple[Hashable, Any]]) -> None:
        """Encode these padded sources (one (key, (beam_size, max_new_tokens)) per row) and add their rows to their
        width classes' cohorts: cross keys/values, an empty self-attention cache and a BOS per beam. Each class is
        encoded in one call of its own, padded to its own longest source: an 8-token source that arrives beside a
        256-token one is not encoded as 256 tokens."""
        lengths = attention_mask.sum(axis=1)
        classes = [self.width_class(int(n)) for n in lengths]
        for width in sorted(set(classes)):
            mine = [row for row, c in enumerate(classes) if c == width]
            used = int(lengths[mine].max())
            cross = self.runtime.encode(input_ids[mine, :used], attention_mask[mine, :used])
            if width not in self.cohorts:
                self.cohorts = dict(sorted({**self.cohorts, width: _Cohort(self.runtime)}.items()))
            self.cohorts[width].add(cross, [sources[row] for row in mine], [int(lengths[row]) for row in mine])
        held = sum(cohort.buffers.nbytes for cohort in self.cohorts.values() if cohort.buffers)
        self.peak_bytes = max(self.peak_bytes, held)

    def step(self, steps: int = 1, widths: Collection[int] | None = None, budget_s: float | None = None) -> StepOutcome:
        """`steps` decoder calls per cohort, one cohort after the other, every live row advancing `steps` tokens
        (fewer if its search ends) -> (sources whose search ended: their tokens, sources whose decoder call raised:
        the error). Both kinds have left. `widths`: only the cohorts of these width classes step (None: all); the
        others wait as they are. `budget_s`: a cohort stops early once this call has taken that long (each still
        takes at least one step). A cohort's calls run back to back because a call right after the same cohort's
        last finds its buffers in the CPU caches: interleaved with the other cohorts' calls and the encoder, the
        same call took 30-40 % longer (issue #17's profile)."""
        finished: dict[Hashable, list[int]] = {}
        failed: dict[Hashable, Exception] = {}
        started = time.perf_counter()
        for width, cohort in self.cohorts.items():
            if widths is not None and width not in widths:
                continue
            for _ in range(steps):
                done, broke = cohort.step()
                finished.update(done)
                failed.update(broke)
                if not cohort.searches or (budget_s is not None and time.perf_counter() - started >= budget_s):
                    break
        if finished or failed:
            self._forget_empty_cohorts()
        return finished, failed

    def drop(self, keys: set) -> None:
        """These sources leave now (their requests are gone): their rows leave the cache."""
        for cohort in self.cohorts.values():
            cohort.drop(keys)
        self._forget_empty_cohorts()

    def _forget_empty_cohorts(self) -> None:
        self.cohorts = {width: cohort for width, cohort in self.cohorts.items() if cohort.searches}
        if not self.cohorts and self.peak_bytes >= BIG_DECODE_BYTES:
            self.runtime.holding = True
            self.peak_bytes = 0


def width_class(source_length: int) -> int:
    """A source's width class (LiveDecode with width classes): the next power of two, at least 64. Each cohort costs
    a decoder call of its own (~0.15 ms at one row): classes from 32 made 4 cohorts under the mixed load and were no
    faster than 3 from 64 (measured when a call still cost its widest source's width)."""
    return max(64, 1 << max(0, source_length - 1).bit_length())


def _round_memory(memory: int) -> int:
    """Cross buffer width: a multiple of 16, so sources of similar lengths do not each reallocate it."""
    return max(16, -(-memory // 16) * 16)
