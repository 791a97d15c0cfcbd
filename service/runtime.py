"""ONNX Runtime behind the one call the batcher makes: padded int64 ids + mask in, one row per text out."""

import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Collection, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


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

    `shrink_from_tokens`: a batch of at least this many padded tokens hands the memory it took back to the OS
    when it ends: ORT's arena frees its unused regions (the run option below) and glibc its freed pages. Smaller
    batches keep what they used in the arena, so the next batch of that size allocates nothing. None: never."""

    def __init__(self, session: ort.InferenceSession, *, shrink_from_tokens: int | None = None):
        self.session = session
        outputs = [o.name for o in session.get_outputs()]
        self._output = "logits" if "logits" in outputs else outputs[0]
        self.shrink_from_tokens = shrink_from_tokens
        self._shrink: ort.RunOptions | None = None  # ORT refuses the option for a session without an arena
        if session.get_session_options().enable_cpu_mem_arena:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    @property
    def provider(self) -> str:
        return self.session.get_providers()[0]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        big = self.shrink_from_tokens is not None and input_ids.size >= self.shrink_from_tokens
        logits = self.session.run([self._output], feeds, self._shrink if big else None)[0]
        if big:
            _return_freed_memory()
        return logits


def probabilities(logits: np.ndarray) -> list[list[float]]:
    """Softmax per row, as Python floats: done once per batch here, not once per text in the event loop."""
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).tolist()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp = ((5 + len) / 6) ** alpha; len counts EOS."""
    return ((5 + length) / 6) ** alpha


class TranslatorRuntime:
    """encoder.onnx once per source, then decoder.onnx one token at a time with its key/value cache.

    `run(input_ids, attention_mask, (beam_size, max_new_tokens), between_steps)` -> one list of target token
    ids per row (no BOS/EOS): a batch of whole requests decoded until its last sentence ends. `between_steps`
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
        self.encoder, self.decoder = encoder, decoder
        self.n_heads, self.head_dim, self.tgt_n_max = n_heads, head_dim, tgt_n_max
        self.bos_id, self.eos_id, self.alpha = bos_id, eos_id, length_penalty_alpha
        kinds = [(i, kind) for i in range(n_layers) for kind in ("key", "value")]
        self.past_names = [f"past_{kind}_{i}" for i, kind in kinds]
        self.present_names = [f"present_{kind}_{i}" for i, kind in kinds]
        self.cross_names = [f"cross_{kind}_{i}" for i, kind in kinds] + ["cross_mask"]

    @property
    def provider(self) -> str:
        return self.decoder.get_providers()[0]

    def live(self) -> "LiveDecode":
        return LiveDecode(self, trim_when_idle=True)

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, options,
        between_steps: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        between_steps = between_steps or (lambda: None)
        live = LiveDecode(self)
        try:
            live.admit(input_ids, attention_mask, [(row, options) for row in range(len(input_ids))])
            outputs: dict[Hashable, list[int]] = {}
            while live.rows:
                between_steps()
                finished, failed = live.step()
                for error in failed.values():
                    raise error
                outputs.update(finished)
            return [outputs[row] for row in range(len(input_ids))]
        finally:
            del live
            _return_freed_memory()  # a decode allocates per step; trimming costs ~1 ms against tens of ms

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
        """Padded sources -> cross keys/values per decoder layer (rows, H, S', hd) and cross_mask (rows, S')."""
        return self.encoder.run(self.cross_names, {"input_ids": input_ids, "attention_mask": attention_mask})

    def step(self, tokens: np.ndarray, cross: list[np.ndarray], past: list[np.ndarray]):
        """(rows, 1) new tokens -> logits of the next token (rows, V) and the grown cache. Every row's cache
        must have the same length: the decoder places the new tokens at the cache's length."""
        feeds = {"input_ids": tokens, **dict(zip(self.cross_names, cross, strict=True))}
        feeds.update(zip(self.past_names, past, strict=True))
        logits, *presents = self.decoder.run(["logits", *self.present_names], feeds)
        return logits[:, -1], presents

    def empty_cache(self, rows: int) -> list[np.ndarray]:
        return [np.zeros((rows, self.n_heads, 0, self.head_dim), np.float32) for _ in self.past_names]


# sources whose search ended -> their target tokens; sources whose decoder call raised -> the error
StepOutcome = tuple[dict[Hashable, list[int]], dict[Hashable, Exception]]


class _Search:
    """One source's search: greedy (beam 1) or beam search over its `beam` consecutive rows of a cohort."""

    def __init__(self, key: Hashable, beam: int, max_new_tokens: int, eos_id: int, alpha: float):
        self.key, self.beam, self.max_new_tokens, self.eos_id, self.alpha = key, beam, max_new_tokens, eos_id, alpha
        self.scores = np.zeros((1, beam), np.float32)
        self.scores[:, 1:] = -np.inf  # all beams start as the same BOS: only the first may expand
        self.generated: list[int] = []  # greedy: the tokens so far
        self.history = np.zeros((beam, 0), dtype=np.int64)  # beam search: tokens of each row so far
        self.finished: list[tuple[float, list[int]]] = []
        self.output: list[int] | None = None  # set when the search ends

    def advance(self, logits: np.ndarray, log_probs: np.ndarray | None, step: int) -> tuple[list[int], list[int]]:
        """This source's rows' next-token logits (beam, V) at `step` -> (rows to keep, their next tokens), both
        empty once the search has ended (then `output` holds the result)."""
        at_limit = step == self.max_new_tokens - 1
        if self.beam == 1:
            token = int(logits[0].argmax())
            if token != self.eos_id:
                self.generated.append(token)
            if token == self.eos_id or at_limit:
                self.output = self.generated
                return [], []
            return [0], [token]
        beam, vocab = self.beam, logits.shape[-1]
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


class _Cohort:
    """Rows whose caches have one length (`step` tokens decoded): one decoder call per step covers them.

    The exported decoder places new tokens at the cache's length and has no mask over cached positions, so
    rows of different lengths cannot share a call without changing the bundle; rows of one length can, whatever
    their sources' lengths (the cross keys are padded and masked, as within any encoder batch)."""

    def __init__(self, cross: list[np.ndarray], past: list[np.ndarray], tokens: np.ndarray, searches: list[_Search]):
        self.cross, self.past, self.tokens, self.searches = cross, past, tokens, searches
        self.step = 0  # tokens decoded so far = the self-attention cache's length

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def cache_tokens(self) -> int:
        """Positions held for these rows: the (padded) source's cross keys and the target so far."""
        return self.rows * (self.cross[0].shape[2] + self.step)

    def absorb(self, other: "_Cohort") -> None:
        """Take in the rows of a cohort of the same length (after this one's rows)."""
        memory = max(self.cross[0].shape[2], other.cross[0].shape[2])
        self.cross = [np.concatenate([_pad_memory(a, memory), _pad_memory(b, memory)])
                      for a, b in zip(self.cross, other.cross, strict=True)]  # fmt: skip
        self.past = [np.concatenate([a, b]) for a, b in zip(self.past, other.past, strict=True)]
        self.tokens = np.concatenate([self.tokens, other.tokens])
        self.searches = self.searches + other.searches

    def keep(self, rows: list[int], tokens: list[int]) -> None:
        """Carry on with these rows (indices into the current ones, in order) and their next tokens."""
        if len(rows) != self.rows or rows != list(range(self.rows)):
            self.cross = [t[rows] for t in self.cross]
            self.past = [t[rows] for t in self.past]
        self.tokens = np.array(tokens, dtype=np.int64).reshape(-1, 1)


def _pad_memory(cross: np.ndarray, memory: int) -> np.ndarray:
    """Cross keys/values (rows, H, S', hd) or cross_mask (rows, S') padded to `memory` positions (masked out)."""
    axis = 2 if cross.ndim == 4 else 1
    missing = memory - cross.shape[axis]
    if missing == 0:
        return cross
    widths = [(0, 0)] * cross.ndim
    widths[axis] = (0, missing)
    return np.pad(cross, widths)  # zeros; False in the mask


class LiveDecode:
    """The sources being decoded, step by step: they join (`admit`), advance one token per `step` and leave
    when their search ends (returned by `step`) or when told to (`drop`). Sources are named by keys the caller
    chooses. Mechanics only: who joins and when is the caller's policy. Not thread-safe: one thread drives it.
    """

    def __init__(self, runtime: TranslatorRuntime, *, trim_when_idle: bool = False):
        """`trim_when_idle`: give freed heap pages back to the OS whenever the last source leaves (as `run` does
        after each batch), so a burst does not leave a long-lived decode loop's process at its peak."""
        self.runtime = runtime
        self.trim_when_idle = trim_when_idle
        self.cohorts: list[_Cohort] = []

    @staticmethod
    def rows_for(options) -> int:
        """Cache rows a source with these options takes: one per beam."""
        beam_size, _ = options
        return beam_size

    @property
    def rows(self) -> int:
        return sum(cohort.rows for cohort in self.cohorts)

    @property
    def lengths(self) -> list[int]:
        """Target lengths decoded so far by the live rows, shortest first: one decoder call each per step."""
        return sorted(cohort.step for cohort in self.cohorts)

    @property
    def cache_tokens(self) -> int:
        return sum(cohort.cache_tokens for cohort in self.cohorts)

    def admit(self, input_ids: np.ndarray, attention_mask: np.ndarray, sources: list[tuple[Hashable, Any]]) -> None:
        """Encode these padded sources (one (key, (beam_size, max_new_tokens)) per row) and add them as a cohort:
        their cross keys/values, one empty self-attention cache row and a BOS per beam."""
        rt = self.runtime
        cross = rt.encode(input_ids, attention_mask)
        beams = np.array([self.rows_for(options) for _, options in sources])
        if (beams != 1).any():
            cross = [np.repeat(t, beams, axis=0) for t in cross]
        searches = [
            _Search(key, beam, min(max_new_tokens, rt.tgt_n_max), rt.eos_id, rt.alpha)
            for key, (beam, max_new_tokens) in sources
        ]
        rows = int(beams.sum())
        tokens = np.full((rows, 1), rt.bos_id, dtype=np.int64)
        self.cohorts.append(_Cohort(cross, rt.empty_cache(rows), tokens, searches))
        self._merge_equal_lengths()

    def step(self, lengths: Collection[int] | None = None) -> StepOutcome:
        """One decoder call for the rows at each of `lengths` (default: all) -> (sources whose search ended:
        their tokens, sources whose decoder call raised: the error). Both kinds have left. Rows that reach the
        length of rows not stepped now join them, so the next step takes them in one call."""
        finished: dict[Hashable, list[int]] = {}
        failed: dict[Hashable, Exception] = {}
        for cohort in [c for c in self.cohorts if lengths is None or c.step in lengths]:
            try:
                finished.update(self._step_cohort(cohort))
            except Exception as error:  # only this cohort's sources fail; the others carry on
                failed.update((search.key, error) for search in cohort.searches)
                self.cohorts.remove(cohort)
        self._merge_equal_lengths()
        if self.trim_when_idle and not self.cohorts:
            _return_freed_memory()
        return finished, failed

    def _merge_equal_lengths(self) -> None:
        by_length: dict[int, _Cohort] = {}
        for cohort in list(self.cohorts):
            if cohort.step in by_length:
                by_length[cohort.step].absorb(cohort)
                self.cohorts.remove(cohort)
            else:
                by_length[cohort.step] = cohort

    def _step_cohort(self, cohort: _Cohort) -> dict[Hashable, list[int]]:
        logits, cohort.past = self.runtime.step(cohort.tokens, cohort.cross, cohort.past)
        log_probs = _log_softmax(logits) if any(search.beam > 1 for search in cohort.searches) else None
        finished, going, rows, tokens, start = {}, [], [], [], 0
        for search in cohort.searches:
            end = start + search.beam
            kept, next_tokens = search.advance(logits[start:end], None if log_probs is None else log_probs[start:end],
                                               cohort.step)  # fmt: skip
            if search.output is not None:
                finished[search.key] = search.output
            else:
                going.append(search)
                rows += [start + row for row in kept]
                tokens += next_tokens
            start = end
        cohort.step += 1
        if going:
            cohort.searches = going
            cohort.keep(rows, tokens)
        else:
            self.cohorts.remove(cohort)
        return finished

    def drop(self, keys: set) -> None:
        """These sources leave now (their requests are gone): their rows leave the cache."""
        for cohort in list(self.cohorts):
            if not any(search.key in keys for search in cohort.searches):
                continue
            rows, going, start = [], [], 0
            for search in cohort.searches:
                if search.key not in keys:
                    going.append(search)
                    rows += range(start, start + search.beam)
                start += search.beam
            if not going:
                self.cohorts.remove(cohort)
                continue
            cohort.searches = going
            cohort.keep(rows, cohort.tokens[rows, 0].tolist())
        if self.trim_when_idle and not self.cohorts:
            _return_freed_memory()
