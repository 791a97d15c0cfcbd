"""ONNX Runtime behind the one call the batcher makes: padded int64 ids + mask in, one row per text out."""

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


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
    model_path: Path, providers: list[str], *, intra_op_threads: int = 0, inter_op_threads: int = 0
) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
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
        return self.session.run([self._output], feeds)[0]
