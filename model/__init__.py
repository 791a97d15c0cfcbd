"""Linformer, Performer and vanilla Transformer models (PyTorch). Training and export use this; serving never does."""

from model.linformer import (
    Classifier,
    Encoder,
    LowRankProjection,
    MaskedLM,
    ModelConfig,
    Translator,
    count_projection_matrices,
)

__all__ = [
    "Classifier",
    "Encoder",
    "LowRankProjection",
    "MaskedLM",
    "ModelConfig",
    "Translator",
    "count_projection_matrices",
]
