"""ONNX Runtime behind the one call the batcher makes: padded int64 ids + mask in, one row per text out."""

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# A batch this big (padded input tokens) or any translation batch is followed by `_return_freed_memory`
BIG_BATCH_TOKENS = 1 << 16


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
    """model.onnx: input_ids, attention_mask int64 [batch, seq] -> logits float32 [batch, num_labels]."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        outputs = [o.name for o in session.get_outputs()]
        self._output = "logits" if "logits" in outputs else outputs[0]

    @property
    def provider(self) -> str:
        return self.session.get_providers()[0]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        logits = self.session.run([self._output], feeds)[0]
        if input_ids.size >= BIG_BATCH_TOKENS:
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
    """encoder.onnx once per batch of sources, then decoder.onnx one token at a time with its key/value cache.

    `run(input_ids, attention_mask, (beam_size, max_new_tokens), between_steps)` -> one list of target token
    ids per row (no BOS/EOS). `between_steps` is called before each decoder step; it raises to stop the
    batch (the batcher's does when nobody waits for the answers any more). A finished sentence leaves the
    batch: its rows are dropped from the cache and the cross keys, so later steps compute only what is still
    being translated. The searches are the same as
    training/decode.py (greedy; beam search with GNMT length penalty, fairseq's finishing rule).
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

    def run(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, options,
        between_steps: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        beam_size, max_new_tokens = options
        max_new_tokens = min(max_new_tokens, self.tgt_n_max)
        between_steps = between_steps or (lambda: None)
        cross = self.encoder.run(self.cross_names, {"input_ids": input_ids, "attention_mask": attention_mask})
        try:
            if beam_size == 1:
                return self.greedy(cross, max_new_tokens, between_steps)
            beams = [np.repeat(t, beam_size, axis=0) for t in cross]
            return self.beam_search(beams, beam_size, max_new_tokens, between_steps)
        finally:
            del cross
            _return_freed_memory()  # a decode allocates per step; trimming costs ~1 ms against tens of ms

    def _step(self, tokens: np.ndarray, cross: list[np.ndarray], past: list[np.ndarray]):
        """(rows, 1) new tokens -> log-probabilities of the next token (rows, V) and the grown cache."""
        feeds = {"input_ids": tokens, **dict(zip(self.cross_names, cross, strict=True))}
        feeds.update(zip(self.past_names, past, strict=True))
        logits, *presents = self.decoder.run(["logits", *self.present_names], feeds)
        return logits[:, -1], presents

    def _empty_cache(self, rows: int) -> list[np.ndarray]:
        return [np.zeros((rows, self.n_heads, 0, self.head_dim), np.float32) for _ in self.past_names]

    def greedy(
        self, cross: list[np.ndarray], max_new_tokens: int, between_steps: Callable[[], None] = lambda: None
    ) -> list[list[int]]:
        B = cross[0].shape[0]
        outputs: list[list[int]] = [[] for _ in range(B)]
        live = np.arange(B)  # sentence of each row still in the batch
        tokens = np.full((B, 1), self.bos_id, dtype=np.int64)
        past = self._empty_cache(B)
        for step in range(max_new_tokens):
            between_steps()
            logits, past = self._step(tokens, cross, past)
            next_tokens = logits.argmax(axis=-1)
            for row, token in zip(live.tolist(), next_tokens.tolist(), strict=True):
                if token != self.eos_id:
                    outputs[row].append(token)
            going = next_tokens != self.eos_id
            if step == max_new_tokens - 1 or not going.any():
                break
            if not going.all():
                cross, past = [t[going] for t in cross], [t[going] for t in past]
                live, next_tokens = live[going], next_tokens[going]
            tokens = next_tokens[:, None].astype(np.int64)
        return outputs

    def beam_search(
        self, cross: list[np.ndarray], beam: int, max_new_tokens: int,
        between_steps: Callable[[], None] = lambda: None,
    ) -> list[list[int]]:
        B = cross[0].shape[0] // beam
        live = list(range(B))  # sentence of each block of `beam` rows
        scores = np.zeros((B, beam), np.float32)
        scores[:, 1:] = -np.inf  # all beams start as the same BOS: only the first may expand
        history = np.zeros((B * beam, 0), dtype=np.int64)
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        tokens = np.full((B * beam, 1), self.bos_id, dtype=np.int64)
        past = self._empty_cache(B * beam)
        for step in range(max_new_tokens):
            between_steps()
            logits, past = self._step(tokens, cross, past)
            vocab = logits.shape[-1]
            candidates = (scores[:, :, None] + _log_softmax(logits).reshape(len(live), beam, vocab)).reshape(
                len(live), -1
            )
            top = np.argpartition(-candidates, 2 * beam, axis=1)[:, : 2 * beam]
            top = np.take_along_axis(top, np.argsort(-np.take_along_axis(candidates, top, 1), 1, kind="stable"), 1)
            at_limit = step == max_new_tokens - 1
            kept, next_rows, next_tokens, next_scores = [], [], [], []
            for block, sentence in enumerate(live):
                chosen = []
                for rank, index in enumerate(top[block].tolist()):
                    score = float(candidates[block, index])
                    source_beam, token = divmod(index, vocab)
                    row = block * beam + source_beam
                    if token == self.eos_id:
                        if rank < beam:
                            hypothesis = history[row].tolist()
                            finished[sentence].append((score / _length_penalty(step + 1, self.alpha), hypothesis))
                    elif len(chosen) < beam:
                        chosen.append((row, token, score))
                if at_limit:  # out of length: the live beams end here, as they are
                    for row, token, score in chosen:
                        hypothesis = history[row].tolist() + [token]
                        finished[sentence].append((score / _length_penalty(step + 1, self.alpha), hypothesis))
                if len(finished[sentence]) >= beam or at_limit:
                    continue
                kept.append(sentence)
                next_rows += [row for row, _, _ in chosen]
                next_tokens += [token for _, token, _ in chosen]
                next_scores += [score for _, _, score in chosen]
            if not kept:
                break
            rows = np.array(next_rows)
            cross, past = [t[rows] for t in cross], [t[rows] for t in past]
            history = np.concatenate([history[rows], np.array(next_tokens, dtype=np.int64)[:, None]], axis=1)
            scores = np.array(next_scores, np.float32).reshape(len(kept), beam)
            tokens = history[:, -1:]
            live = kept
        return [max(hypotheses, key=lambda h: h[0])[1] for hypotheses in finished]
