"""Bundle files shared by every export: config.json, manifest.json (sha256 of every file), versions."""

from __future__ import annotations

import json
import platform
from importlib.metadata import version
from pathlib import Path

from training.provenance import sha256_of


def versions() -> dict[str, str]:
    names = ("torch", "onnx", "onnxruntime", "sentencepiece", "numpy")
    return {"python": platform.python_version(), **{name: version(name) for name in names}}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_manifest(bundle: Path) -> dict[str, str]:
    """manifest.json lists the sha256 of every other file; the service refuses a bundle that differs."""
    files = {p.name: sha256_of(p) for p in sorted(bundle.iterdir()) if p.is_file() and p.name != "manifest.json"}
    write_json(bundle / "manifest.json", {"files": files})
    return files
