"""What the worker reads from an ORT-GenAI model folder's genai_config.json, and the og.Config it loads
the model with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnxruntime_genai as og

from worker.engines.device import Device


def load_config(
    model_dir: Path,
    device: Device,
    batching: Mapping[str, Any] | None = None,
    *,
    cuda_graph: str = "auto",
) -> og.Config:
    """The model's og.Config on the device, with `batching` overlaid on the engine's batching section
    (dynamic_batching where the model has paged attention, else static_batching) and the CUDA provider
    options of cuda_provider_options (ORTFLEET_CUDA_GRAPH)."""
    config = og.Config(str(model_dir))
    config.clear_providers()
    options = cuda_provider_options(device, cuda_graph, uses_dynamic_batching(model_dir))
    if options:
        config.append_provider("cuda")
        for name, value in options.items():
            config.set_provider_option("cuda", name, value)
    if batching:
        section = "dynamic_batching" if uses_dynamic_batching(model_dir) else "static_batching"
        config.overlay(json.dumps({"engine": {section: dict(batching)}}))
    return config


def cuda_provider_options(device: Device, cuda_graph: str, paged: bool) -> dict[str, str]:
    """The CUDA provider options the worker loads a model with ({} on the CPU: no CUDA provider).

    enable_cuda_graph (ORTFLEET_CUDA_GRAPH): `on` and `off` say it; `auto` turns it on for models with
    paged attention (`paged`: og.Engine's dynamic batching) and off for the others. What ORT-GenAI 0.18
    does with it: og.Engine's paged decoder captures only pure-decode steps, where every row brings the
    same number of tokens (prefill and mixed steps run eagerly, `gpu_graph_id` -1); one graph per
    shape (rows, tokens per row, block-table width rounded up to a power of two, at least 8 columns),
    with a bounded number of shapes; a step wider than the persistent buffers sized from the engine's
    max_batch_size, or a block table wider than the reserved capacity, runs eagerly. The buffers and the
    captured graphs take device memory beside the KV cache. Outside og.Engine's paged path ORT's own
    rules apply: every node on the CUDA provider, input and output shapes fixed between replays, and
    ORT-GenAI refuses graph capture where past_present_share_buffer is false; the model builder writes
    enable_cuda_graph "0" unless asked, as ortfleet's recipes do, so the worker sets it here."""
    if device.kind != "cuda":
        return {}
    if cuda_graph not in ("auto", "on", "off"):
        raise ValueError(f"cuda_graph must be auto, on or off, not {cuda_graph!r}")
    graph = cuda_graph == "on" or (cuda_graph == "auto" and paged)
    return {"device_id": str(device.index or 0), "enable_cuda_graph": "1" if graph else "0"}


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


def eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The model's end-of-sequence ids, as genai_config.json gives them (one id or a list)."""
    eos = read_genai(model_dir)["model"]["eos_token_id"]
    return frozenset(eos if isinstance(eos, list) else [eos])
