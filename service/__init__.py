"""HTTP service: FastAPI routes -> dynamic batcher -> ONNX Runtime. Never imports torch or onnx."""

import os

# ONNX Runtime's official Linux builds (1.29 and later) keep a device id and queue usage events (model file names,
# graph hashes) in the user's cache for upload to Microsoft, unless this is set before ONNX Runtime starts. A
# serving process should not reach out on its own: off, unless the operator sets it (ORT_DISABLE_TELEMETRY=0).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
