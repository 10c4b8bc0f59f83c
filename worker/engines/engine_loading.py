"""Loading what a worker runs: its model folder checked, its device chosen, its engine opened in this
process. The worker (worker/main.py) and an engine core (worker/core/) load through here alike."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from common.collector import calm_garbage_collector
from common.model_folder import (
    GENAI_CONFIG,
    default_model_dir,
    is_complete,
    mismatched_files,
    missing_files,
    read_marker,
)
from common.startup import CannotStart
from common.worker_settings import WorkerSettings
from worker.engine import Engine, Tokenizer
from worker.engines.device import Device, DeviceError, parse_device
from worker.engines.engine_choice import engine_kind, open_engine

REBUILD = "rebuild the folder (`ortfleet model`), or pass another --model"

logger = logging.getLogger("worker")


def resolve_model(settings: WorkerSettings) -> Path:
    if settings.model is not None:
        model = settings.model.expanduser().resolve()
    else:
        model = default_model_dir(settings.model_cache)
        if not is_complete(model):
            raise CannotStart(
                f"the default model in {model} is missing or incomplete; "
                "build it with `ortfleet model default` or pass --model DIR"
            )
    if not (model / GENAI_CONFIG).is_file():
        raise CannotStart(
            f"{model} is not an ORT-GenAI model folder (no {GENAI_CONFIG}); "
            "build the default model with `ortfleet model default` or pass --model DIR"
        )
    check_model_folder(model, verify_weights=settings.verify_weights)
    return model


def check_model_folder(model: Path, *, verify_weights: bool = True) -> None:
    """CannotStart for the mistakes in a model folder that can be seen without loading it: a
    genai_config.json that is not a JSON object, a file its build marker lists gone missing or changed
    (by size, or by sha256: every file with `verify_weights`, else those up to 8 MB)."""
    config = model / GENAI_CONFIG
    try:
        genai = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CannotStart(f"{config} cannot be read as JSON ({e}); {REBUILD}") from e
    if not isinstance(genai, dict) or not isinstance(genai.get("model"), dict):
        raise CannotStart(f'{config} has no "model" section; {REBUILD}')
    missing = missing_files(model)
    if missing:
        raise CannotStart(f"the model folder {model} lacks {', '.join(missing)}; {REBUILD}")
    marker = read_marker(model)
    if marker is None:
        return
    began = time.monotonic()
    changed = mismatched_files(model, marker, verify_all_hashes=verify_weights)
    if changed:
        raise CannotStart(
            f"in the model folder {model}, {', '.join(changed)} differs from its build marker (size or "
            f"sha256): corrupt, or changed since the build; {REBUILD}"
        )
    logger.info("%s matches its build marker (checked in %.2f s)", model, time.monotonic() - began)


def chosen_device(settings: WorkerSettings) -> Device:
    """The device the settings name (auto: CUDA where this ORT-GenAI build can use it)."""
    import onnxruntime_genai as og

    try:
        return parse_device(settings.device, og.is_cuda_available)
    except DeviceError as e:
        raise CannotStart(str(e)) from e


def local_engine(
    settings: WorkerSettings, model_dir: Path | None, fake_engine: str | None, device: Device
) -> tuple[Engine, Tokenizer]:
    """The engine in this process (the worker's own, or an engine core's) and its tokenizer."""
    if fake_engine is None and model_dir is not None:
        kind = engine_kind(settings.scheduler, model_dir, device)
        logger.info("loading %s on %s (%s)", model_dir, device, kind)
    from worker.engines.batcher.lora import AdapterMismatch, AdapterUnreadable
    from worker.engines.batcher.lora_graph import LoraGraphError

    try:
        engine = open_engine(model_dir, device, settings, fake_engine)
    except (AdapterMismatch, AdapterUnreadable) as e:
        raise CannotStart(f"{e}; correct or leave out that --lora (ORTFLEET_LORA_MODULES)") from e
    except LoraGraphError as e:
        raise CannotStart(
            f"the model in {model_dir} cannot take LoRA adapters: {e}; leave out --lora "
            "(ORTFLEET_LORA_MODULES)"
        ) from e
    except (RuntimeError, ValueError, OSError) as e:  # what ORT-GenAI raises for a model it cannot load
        reason = " ".join(str(e).split())
        raise CannotStart(
            f"ONNX Runtime GenAI cannot load the model in {model_dir}: {reason}; {REBUILD}"
        ) from e
    return engine, engine.tokenizer


# Allocations between two young collections once the engine is loaded (CPython's default: 700). A step of
# 512 rows makes some 3,000 objects that live until the step ends; at 700 the collector walked each of them
# a few times and moved them up to the older generations, whose walks then came often.
YOUNG_COLLECTION_ALLOCATIONS = 20_000


def freeze_loaded_objects() -> None:
    """Puts every object alive once the engine is loaded (modules, the session, the tokenizer, the
    settings) out of the garbage collector's walks, and collects young objects less often. A busy engine
    makes a few objects a row each step, so full collections came often, and each walked all of these
    again: at 512 rows on a fake 4 ms device, full collections took the paged engine's host step from
    1.7-1.8 to 2.8-2.9 ms. Objects made later are collected as before, reference cycles among them a
    little later (YOUNG_COLLECTION_ALLOCATIONS)."""
    calm_garbage_collector(YOUNG_COLLECTION_ALLOCATIONS)
