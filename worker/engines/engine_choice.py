"""Which engine runs a model on a device: ortfleet's batcher or og.Engine. The worker and the benches that
measure its engine alone open it through here, so both run the same engine with the same settings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from common.startup import CannotStart
from common.worker_settings import WorkerSettings
from worker.engines.device import Device

if TYPE_CHECKING:
    from worker.engines.batcher.engine import BatchingEngine
    from worker.engines.ort_engine import OrtEngine


def uses_batcher(scheduler: str, model_dir: Path, device: Device) -> bool:
    """Whether ortfleet's batcher runs the model (ORTFLEET_SCHEDULER): it runs on CPU only, and `auto`
    keeps og.Engine where it batches continuously itself (paged attention) or runs on a GPU."""
    from worker.engines.genai_config import uses_dynamic_batching

    if scheduler == "og-engine":
        return False
    if device.kind != "cpu":
        if scheduler == "batcher":
            raise CannotStart(
                "ortfleet's batcher runs on CPU only; use --device cpu or --scheduler og-engine"
            )
        return False
    return scheduler == "batcher" or not uses_dynamic_batching(model_dir)


def open_engine(model_dir: Path, device: Device, settings: WorkerSettings) -> OrtEngine | BatchingEngine:
    """The engine a worker with these settings runs the model with on the device (loads the model)."""
    from worker.engines.batcher.engine import BatchingEngine
    from worker.engines.ort_engine import OrtEngine

    if uses_batcher(settings.scheduler, model_dir, device):
        return BatchingEngine(
            model_dir,
            settings.max_batch_size,
            settings.kv_budget_tokens,
            settings.prefill_chunk_tokens,
            settings.step_delay_s,
            settings.prefix_cache,
        )
    return OrtEngine(
        model_dir,
        device,
        settings.max_batch_size,
        settings.step_delay_s,
        target_itl_ms=settings.target_itl_ms,
        gpu_kv_fraction=settings.gpu_kv_fraction,
        # og.Engine's prefix cache knows no tenant: shared only where every request may share
        prefix_caching=settings.prefix_cache and settings.prefix_cache_scope == "fleet",
        cuda_graph=settings.cuda_graph,
    )


def engine_kind(scheduler: str, model_dir: Path, device: Device) -> str:
    return "ortfleet's batcher" if uses_batcher(scheduler, model_dir, device) else "og.Engine"
