"""What the worker reads from an ORT-GenAI model folder's genai_config.json, and the og.Config it loads
the model with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnxruntime_genai as og

from worker.device import Device


def load_config(model_dir: Path, device: Device, batching: Mapping[str, Any] | None = None) -> og.Config:
    """The model's og.Config on the device, with `batching` overlaid on the engine's batching section
    (dynamic_batching where the model has paged attention, else static_batching)."""
    config = og.Config(str(model_dir))
    config.clear_providers()
    if device.kind == "cuda":
        config.append_provider("cuda")
        config.set_provider_option("cuda", "device_id", str(device.index or 0))
    if batching:
        section = "dynamic_batching" if uses_dynamic_batching(model_dir) else "static_batching"
        config.overlay(json.dumps({"engine": {section: dict(batching)}}))
    return config


def read_genai(model_dir: Path) -> dict[str, Any]:
    """The folder's genai_config.json, parsed."""
    genai: dict[str, Any] = json.loads((model_dir / "genai_config.json").read_text())
    return genai


def uses_dynamic_batching(model_dir: Path) -> bool:
    genai = read_genai(model_dir)
    return "dynamic_batching" in genai.get("engine", {})


def context_length(model_dir: Path) -> int:
    genai = read_genai(model_dir)
    try:
        return int(genai["model"]["context_length"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{model_dir}/genai_config.json has no model.context_length") from e


def vocab_size(model_dir: Path) -> int | None:
    genai = read_genai(model_dir)
    size = genai.get("model", {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None
