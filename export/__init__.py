"""Checkpoint -> ONNX bundle (uses torch; the service only reads the bundles)."""

import os

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # as the service does (service/__init__.py)
