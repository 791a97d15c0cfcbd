"""HTTP service: FastAPI routes -> dynamic batcher -> ONNX Runtime. Never imports torch or onnx."""
