"""Checkpoint -> ONNX bundle (uses torch; the service only reads the bundles)."""
