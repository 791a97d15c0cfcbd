"""All service settings in one object, read once from `LINFORMER_*` environment variables."""

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LINFORMER_", extra="ignore")

    # where bundles live: models/<CLASSIFY_MODEL>/, models/<TRANSLATE_MODEL>/ (relative to the cwd)
    models_dir: Path = Path("models")
    classify_model: str = "classify-linformer"
    translate_model: str = "translate-linformer"

    # dynamic batching (policy in service/batcher.py)
    max_batch_size: int = Field(32, ge=1)
    # padded tokens in one batch: batch size x longest sequence
    max_batch_tokens: int = Field(16384, ge=1)
    # How long the oldest queued text may wait for companions while the runtime is idle. Like Triton's
    # max_queue_delay, 0 by default: under load batches still form from the texts that queue up while
    # the previous batch computes; a positive value trades single-user latency for fuller batches.
    max_wait_ms: float = Field(0.0, ge=0)
    # texts waiting per model; beyond it requests get 429
    max_queue: int = Field(256, ge=1)
    request_timeout_s: float = Field(30.0, gt=0)
    max_texts_per_request: int = Field(64, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1)

    # ONNX Runtime
    ort_intra_op_threads: int = Field(0, ge=0)  # 0 = ORT default (one per physical core)
    ort_inter_op_threads: int = Field(0, ge=0)
    execution_provider: Literal["auto", "cpu", "cuda"] = "auto"

    # server
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value
