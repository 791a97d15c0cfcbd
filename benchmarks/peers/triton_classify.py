"""The classify bundle behind Triton's dynamic batcher (PyTriton: the tritonserver binary, a Python model),
configured per its docs for the lowest latency: max_batch_size 32, max_queue_delay_microseconds 0 (batches form
from what queued while the previous one ran).

    LINFORMER_BUNDLE=models/classify-linformer python benchmarks/peers/triton_classify.py --port 8000
    curl -X POST localhost:8000/v2/models/classify/infer \\
         -d '{"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["A wonderful film."]}]}'
"""

import argparse
import json
import os

import numpy as np
from classify_model import BundleClassifier
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    model = BundleClassifier(os.environ["LINFORMER_BUNDLE"])

    @batch
    def infer(text: np.ndarray) -> dict[str, np.ndarray]:  # (batch, 1) bytes -> (batch, 1) JSON bytes
        results = model.classify([row[0].decode() for row in text])
        return {"result": np.array([[json.dumps(r).encode()] for r in results], dtype=np.object_)}

    config = TritonConfig(http_port=args.port, grpc_port=args.port + 1, metrics_port=args.port + 2,
                          log_verbose=0)  # fmt: skip
    with Triton(config=config) as triton:
        triton.bind(
            model_name="classify", infer_func=infer,
            inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
            outputs=[Tensor(name="result", dtype=bytes, shape=(1,))],
            config=ModelConfig(max_batch_size=32, batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
        )  # fmt: skip
        triton.serve()


if __name__ == "__main__":
    main()
