"""Which engine runs a model on a device: ortfleet's batcher or og.Engine. The worker and the benches that
measure its engine alone open it through here, so both run the same engine with the same settings."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, overload

from common.startup import CannotStart
from common.worker_settings import WorkerSettings
from worker.engines.device import Device

BATCHER = "ortfleet's batcher"
PAGED = "ortfleet's paged engine"
SERVES_ADAPTERS = (BATCHER, PAGED)  # the engines that serve LoRA adapters

if TYPE_CHECKING:
    from worker.engines.batcher.engine import BatchingEngine
    from worker.engines.fake_engine import FakeEngine
    from worker.engines.ort_engine import OrtEngine


def uses_batcher(scheduler: str, model_dir: Path, device: Device) -> bool:
    """Whether ortfleet's batcher runs the model (ORTFLEET_SCHEDULER): it runs on CPU only, and `auto`
    keeps og.Engine where it batches continuously itself (paged attention) or runs on a GPU."""
    from worker.engines.genai_config import uses_dynamic_batching

    if scheduler in ("og-engine", "paged"):
        return False
    if device.kind != "cpu":
        if scheduler == "batcher":
            raise CannotStart(
                "ortfleet's batcher runs on CPU only; use --device cpu or --scheduler og-engine"
            )
        return False
    return scheduler == "batcher" or not uses_dynamic_batching(model_dir)


def uses_paged_engine(scheduler: str, model_dir: Path, device: Device) -> bool:
    """Whether ortfleet's paged engine runs the model (ORTFLEET_SCHEDULER=paged): on a GPU, the model
    built with paged attention for CUDA; on the CPU, a CPU model's own graph through the same block tables
    (worker/engines/paged/cpu_model.py). Refuses a model the device cannot run, by name."""
    from worker.engines.genai_config import uses_dynamic_batching

    if scheduler != "paged":
        return False
    paged = uses_dynamic_batching(model_dir)
    if device.kind == "cuda" and not paged:
        raise CannotStart(
            f"--scheduler paged on a GPU needs a model built with paged attention for CUDA; {model_dir} is "
            "not one (ortfleet model default --device cuda builds one)"
        )
    if device.kind != "cuda" and paged:
        raise CannotStart(
            f"{model_dir} is built with paged attention, which runs on CUDA only: use --device cuda"
        )
    return True


def open_paged_engine(model_dir: Path, device: Device, settings: WorkerSettings) -> BatchingEngine:
    """The paged engine. On a GPU: a pool of KV blocks sized as og.Engine's cache would be (row_sizing),
    at most 256 rows a run (the paged operator's limit). On the CPU: blocks of a prefill chunk, as many as
    ORTFLEET_KV_BUDGET_TOKENS holds (else every row at the full context), over the model's CPU graph. Its
    LoRA adapters (ORTFLEET_LORA_MODULES) go to its runner's graph, on the card for a GPU. On a GPU its
    pure-decode runs replay CUDA graphs unless ORTFLEET_CUDA_GRAPH=off (paged/model.py)."""
    from worker.engines.batcher.adapter_library import AdapterLibrary
    from worker.engines.batcher.engine import DEFAULT_SLOTS
    from worker.engines.device_sampling.runner import SamplerGraph
    from worker.engines.genai_config import context_length, cuda_provider_options, read_genai
    from worker.engines.paged.cpu_model import CpuPagedModel
    from worker.engines.paged.engine import PagedEngine, PagedRunner
    from worker.engines.paged.model import MAX_ROWS, PagedModel, paged_graph
    from worker.engines.row_sizing import gpu_memory, kv_geometry, plan_kv, weights_bytes

    context = context_length(model_dir)
    runner: Callable[[], PagedRunner]
    if device.kind == "cuda":
        genai = read_genai(model_dir)
        block_size = kv_geometry(genai).block_size
        memory = gpu_memory(device.gpu_label)
        total, free = memory if memory is not None else (None, None)
        plan = plan_kv(genai, context, total, free, weights_bytes(model_dir), settings.gpu_kv_fraction)
        if plan.tokens < block_size:
            raise CannotStart(f"the paged engine found no memory for its KV pool on {device} ({plan.source})")
        blocks = plan.tokens // block_size
        capacity = min(settings.max_batch_size or MAX_ROWS, MAX_ROWS)
        providers: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")
        card = device.index or 0
        library = AdapterLibrary(
            model_dir, settings.lora_modules, partial(paged_graph, model_dir, card), ("cuda", card)
        )
        # ORTFLEET_CUDA_GRAPH as og.Engine reads it for a paged model: auto and on capture, off does not
        graphs = cuda_provider_options(device, settings.cuda_graph, paged=True)["enable_cuda_graph"] == "1"
        runner = partial(PagedModel, model_dir, blocks, block_size, card, adapters=library, cuda_graph=graphs)
    else:
        block_size = settings.prefill_chunk_tokens
        capacity = settings.max_batch_size or DEFAULT_SLOTS
        blocks = max((settings.kv_budget_tokens or capacity * context) // block_size, 1)
        providers = ("CPUExecutionProvider",)
        library = AdapterLibrary(model_dir, settings.lora_modules)
        runner = partial(CpuPagedModel, model_dir, blocks, block_size, adapters=library)
    sampler = partial(SamplerGraph, providers=providers) if settings.sampling == "graph" else None
    return PagedEngine(
        model_dir,
        runner,
        capacity,
        settings.prefill_chunk_tokens,
        settings.step_delay_s,
        settings.prefix_cache,
        sampler,
        adapters=library,
    )


def adapters_refusal(
    settings: WorkerSettings, model_dir: Path | None, device: Device, fake: bool
) -> str | None:
    """Why a worker with these settings serves no LoRA adapter: only ortfleet's batcher and its paged
    engine serve them (None: it runs one of them). At start (open_engine) and for adapters loaded at run
    time alike."""
    engine = (
        "a fake engine" if fake or model_dir is None else engine_kind(settings.scheduler, model_dir, device)
    )
    if engine in SERVES_ADAPTERS:
        return None
    return (
        f"LoRA adapters are served only by ortfleet's batcher (--scheduler batcher, CPU) and its paged "
        f"engine (--scheduler paged), and this worker runs {engine}"
    )


@overload
def open_engine(
    model_dir: Path, device: Device, settings: WorkerSettings, fake_engine: None = None
) -> OrtEngine | BatchingEngine: ...


@overload
def open_engine(
    model_dir: Path | None, device: Device, settings: WorkerSettings, fake_engine: str | None
) -> OrtEngine | BatchingEngine | FakeEngine: ...


def open_engine(
    model_dir: Path | None, device: Device, settings: WorkerSettings, fake_engine: str | None = None
) -> OrtEngine | BatchingEngine | FakeEngine:
    """The engine a worker with these settings runs the model with on the device (loads the model), or
    the fake engine `fake_engine` describes (DELAY_MS:CAPACITY[:static]); CannotStart for adapters
    (ORTFLEET_LORA_MODULES) on an engine that serves none."""
    from worker.engines.batcher.engine import BatchingEngine
    from worker.engines.ort_engine import OrtEngine

    if settings.lora_modules and (
        refusal := adapters_refusal(settings, model_dir, device, bool(fake_engine))
    ):
        names = ", ".join(sorted(settings.lora_modules))
        raise CannotStart(
            f"{refusal}; leave out its adapters ({names}; --lora, ORTFLEET_LORA_MODULES), or run the "
            "batcher or the paged engine"
        )
    if fake_engine is not None or model_dir is None:
        return _fake_engine(fake_engine or "")
    if uses_paged_engine(settings.scheduler, model_dir, device):
        return open_paged_engine(model_dir, device, settings)
    if uses_batcher(settings.scheduler, model_dir, device):
        return BatchingEngine(
            model_dir,
            settings.max_batch_size,
            settings.kv_budget_tokens,
            settings.prefill_chunk_tokens,
            settings.step_delay_s,
            settings.prefix_cache,
            adapters=settings.lora_modules,
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


def _fake_engine(described: str) -> FakeEngine:
    from worker.engines.fake_engine import FakeEngine, fake_engine_is_static, parse_fake_engine

    try:
        delay_s, capacity = parse_fake_engine(described)
    except ValueError as e:
        raise CannotStart(str(e)) from e
    return FakeEngine(delay_s, capacity, continuous_batching=not fake_engine_is_static(described))


def engine_kind(scheduler: str, model_dir: Path, device: Device) -> str:
    if uses_paged_engine(scheduler, model_dir, device):
        return PAGED
    return BATCHER if uses_batcher(scheduler, model_dir, device) else "og.Engine"
