"""Load a model bundle (models/<name>/) and verify it against its manifest before anything runs it."""

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class BundleError(RuntimeError):
    """A bundle exists but cannot be served: refuse to start rather than serve something unverified."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    name: str
    task: str  # "classify" | "translate"
    attention: str  # "linformer" | "transformer"
    n_max: int
    k: int | None
    labels: list[str]
    pad_id: int
    bos_id: int
    eos_id: int
    add_bos: bool
    add_eos: bool
    onnx_files: dict[str, str]  # role ("model", "encoder", "decoder") -> file name
    config: dict[str, Any] = field(repr=False)
    # the batcher's padded-token budget measured for this model (manifest.json `batching`), if any
    max_batch_tokens: int | None = None
    # under it, the batch size measured best per padded length (`batching.max_batch_size_by_length`), if any
    max_batch_size_by_length: dict[int, int] | None = None

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.model"

    def onnx_path(self, role: str = "model") -> Path:
        return self.path / self.onnx_files[role]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_manifest(path: Path) -> dict[str, Any]:
    """Every file listed in manifest.json must exist and match its sha256; returns the parsed manifest."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise BundleError(f"bundle {path} has no manifest.json; re-export it")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"bundle {path}: manifest.json is unreadable ({e})") from e
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise BundleError(f"bundle {path}: {name} is listed in manifest.json but missing")
        actual = sha256_of(file)
        if actual != expected:
            raise BundleError(
                f"bundle {path}: {name} does not match manifest.json "
                f"(sha256 {actual[:12]}..., expected {expected[:12]}...); the bundle is corrupt or was "
                "edited after export"
            )
    return manifest


def load_bundle(path: Path) -> Bundle:
    """Verify then parse a bundle directory; raises BundleError with a message a person can act on."""
    path = Path(path)
    manifest = verify_manifest(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"bundle {path}: config.json is unreadable ({e})") from e
    try:
        task = config["task"]
        special = config.get("special_tokens", {})
        onnx_files = dict(config.get("onnx") or {"model": "model.onnx"})
        bundle = Bundle(
            path=path,
            name=config.get("name", path.name),
            task=task,
            attention=config.get("attention", "unknown"),
            n_max=int(config["n_max"]),
            k=config.get("k"),
            labels=list(config.get("labels") or []),
            pad_id=int(special.get("pad_id", 0)),
            bos_id=int(special.get("bos_id", 2)),
            eos_id=int(special.get("eos_id", 3)),
            add_bos=bool(config.get("add_bos", True)),
            add_eos=bool(config.get("add_eos", False)),
            onnx_files=onnx_files,
            config=config,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"bundle {path}: config.json lacks or mangles a required key ({e})") from e
    for name in ["config.json", "tokenizer.model", *onnx_files.values()]:
        if name not in manifest["files"]:
            raise BundleError(f"bundle {path}: {name} is not listed in manifest.json, so it is unverified")
    budget = manifest.get("batching", {}).get("max_batch_tokens")
    if budget is not None:
        if not isinstance(budget, int) or budget < 1:
            raise BundleError(f"bundle {path}: manifest.json batching.max_batch_tokens must be a positive integer, "
                              f"got {budget!r}; re-run `python -m export calibrate --bundle {path}`")  # fmt: skip
        bundle = replace(bundle, max_batch_tokens=budget)
    by_length = manifest.get("batching", {}).get("max_batch_size_by_length")
    if by_length is not None:  # absent in bundles calibrated before it: the budget alone decides, as it did
        try:
            sizes = {int(length): size for length, size in by_length.items()}
            if not sizes or not all(isinstance(n, int) and n >= 1 and length >= 1 for length, n in sizes.items()):
                raise ValueError("lengths and sizes must be positive integers")
        except (AttributeError, TypeError, ValueError) as e:
            raise BundleError(f"bundle {path}: manifest.json batching.max_batch_size_by_length must map lengths to "
                              f"positive batch sizes ({e}); re-run `python -m export calibrate --bundle {path}`") from e
        bundle = replace(bundle, max_batch_size_by_length=dict(sorted(sizes.items())))
    if task == "classify" and not bundle.labels:
        raise BundleError(f"bundle {path}: a classify bundle needs a non-empty 'labels' list")
    return bundle
