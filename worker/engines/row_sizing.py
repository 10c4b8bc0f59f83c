"""How many rows a GPU worker runs at once: bounded by the KV memory it gets and the context (every row
it admits can grow to the full context), then by a target inter-token latency measured on the card.

og.Engine's dynamic batching takes `max_batch_size` when the engine is made, and its paged KV cache from
`num_blocks` (or a fraction of the free device memory). The worker makes the engine with the ceiling the
KV memory allows, then times decode steps at growing row counts (`calibrate`) and serves with the most
rows whose step stays within the target: the knee past which more rows cost every stream latency.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# og.Engine's row limit (the model builder refuses a larger max_batch_size).
ROW_LIMIT = 256
# og's own share of the free device memory for the paged KV cache when genai_config names none.
DEFAULT_UTILIZATION = 0.6
KV_BYTES_PER_VALUE = 2  # paged KV is fp16 or bf16
# The share of the target ITL the engine's decode step may take. The rest is the worker's own work on each
# step's tokens (detokenizing, stop strings, the stream writes), which grows with the rows: on an H200 one
# worker sized to 256 rows by a 12 ms step (8 ms measured) served 5,960 tokens/s at an ITL p50 of 27 ms,
# where 64 rows had given 10,050 at 5.2 ms (docs/performance.md, "On a GPU").
ENGINE_SHARE_OF_ITL = 0.5
_NVIDIA_SMI_TIMEOUT_S = 20.0


class RowSizingError(ValueError):
    pass


@dataclass(frozen=True)
class KvGeometry:
    layers: int
    kv_heads: int
    head_size: int
    block_size: int  # tokens per paged KV block

    @property
    def token_bytes(self) -> int:
        """Bytes one token of context holds in the KV cache: a key and a value per layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_size * KV_BYTES_PER_VALUE


def kv_geometry(genai: Mapping[str, Any]) -> KvGeometry:
    decoder = genai.get("model", {}).get("decoder", {})
    batching = genai.get("engine", {}).get("dynamic_batching", {})
    try:
        return KvGeometry(
            layers=int(decoder["num_hidden_layers"]),
            kv_heads=int(decoder["num_key_value_heads"]),
            head_size=int(decoder["head_size"]),
            block_size=int(batching.get("block_size", 256)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise RowSizingError(
            f"genai_config.json lacks the decoder's {e}: the KV cache cannot be sized"
        ) from e


@dataclass(frozen=True)
class KvPlan:
    """The paged KV cache a worker asks og.Engine for, and the rows it can hold."""

    tokens: int  # of context, over all rows
    num_blocks: int | None  # pinned in the engine's config; None leaves og its own share of free memory
    ceiling: int  # rows: every one can reach the full context, at most ROW_LIMIT
    source: str  # how the KV memory was decided, for the log

    def overlay(self) -> dict[str, Any]:
        """genai_config's engine.dynamic_batching entries that give og.Engine this plan."""
        entries: dict[str, Any] = {"max_batch_size": self.ceiling}
        if self.num_blocks is not None:
            entries["num_blocks"] = self.num_blocks
        return entries


def plan_kv(
    genai: Mapping[str, Any],
    context_length: int,
    total_bytes: int | None,
    free_bytes: int | None,
    weights_bytes: int,
    kv_fraction: float | None,
) -> KvPlan:
    """The KV cache and row ceiling on one GPU: with `kv_fraction`, that share of the card's memory
    (`total_bytes`: how several workers share one card); else genai_config's num_blocks when it pins one;
    else og's rule, its utilization factor times the memory left free once the weights are loaded."""
    geometry = kv_geometry(genai)
    batching = genai.get("engine", {}).get("dynamic_batching", {})
    block_bytes = geometry.block_size * geometry.token_bytes
    if kv_fraction is not None:
        if total_bytes is None:
            raise RowSizingError("a share of the GPU's memory was asked for, but its size is unknown")
        blocks = int(kv_fraction * total_bytes) // block_bytes
        if blocks < 1:
            raise RowSizingError(
                f"{kv_fraction:.0%} of the GPU's {total_bytes / 2**30:.1f} GiB holds no KV block of "
                f"{block_bytes / 2**20:.1f} MiB"
            )
        return _plan(blocks * geometry.block_size, blocks, context_length, f"{kv_fraction:.0%} of the card")
    if "num_blocks" in batching:
        blocks = int(batching["num_blocks"])
        return _plan(blocks * geometry.block_size, None, context_length, "genai_config's num_blocks")
    if free_bytes is None:
        return KvPlan(0, None, ROW_LIMIT, "unknown (no memory reading): og's own share")
    factor = float(batching.get("gpu_utilization_factor", DEFAULT_UTILIZATION))
    tokens = int(factor * max(free_bytes - weights_bytes, 0)) // geometry.token_bytes
    return _plan(tokens, None, context_length, f"{factor:.0%} of the free memory")


def _plan(tokens: int, num_blocks: int | None, context_length: int, source: str) -> KvPlan:
    ceiling = max(1, min(ROW_LIMIT, tokens // max(context_length, 1)))
    return KvPlan(tokens, num_blocks, ceiling, source)


@dataclass(frozen=True)
class StepTiming:
    rows: int
    step_ms: float  # median decode step with `rows` rows


@dataclass
class RowSizing:
    """What the worker measured and chose; `rows` is its capacity."""

    kv: KvPlan
    target_itl_ms: float | None
    timings: list[StepTiming] = field(default_factory=list)
    rows: int = 0

    @property
    def step_budget_ms(self) -> float | None:
        return None if self.target_itl_ms is None else step_budget_ms(self.target_itl_ms)

    def describe(self) -> str:
        curve = ", ".join(f"{t.rows}: {t.step_ms:.2f} ms" for t in self.timings) or "not measured"
        return (
            f"{self.rows} rows (KV: {self.kv.tokens:,} tokens, {self.kv.source}; ceiling {self.kv.ceiling}; "
            f"target ITL {self.target_itl_ms} ms, of it the engine's step {self.step_budget_ms} ms; "
            f"decode step by rows: {curve})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "ceiling": self.kv.ceiling,
            "kv_tokens": self.kv.tokens,
            "kv_source": self.kv.source,
            "target_itl_ms": self.target_itl_ms,
            "step_budget_ms": self.step_budget_ms,
            # None: no step had every row decoding (the probe could not time that many rows)
            "step_ms_by_rows": {
                str(t.rows): round(t.step_ms, 3) if math.isfinite(t.step_ms) else None for t in self.timings
            },
        }


def probe_rows(ceiling: int) -> list[int]:
    """Row counts to time, doubling from 1 up to the ceiling (which is always among them)."""
    counts = []
    rows = 1
    while rows < ceiling:
        counts.append(rows)
        rows *= 2
    return [*counts, ceiling]


def step_budget_ms(target_itl_ms: float) -> float:
    """How long the engine's decode step may take for the worker to keep its streams within the target
    ITL: its share (ENGINE_SHARE_OF_ITL), the rest left to the worker's work on the step's tokens."""
    return target_itl_ms * ENGINE_SHARE_OF_ITL


def calibrate(
    ceiling: int, target_itl_ms: float, step_ms: Callable[[int], float]
) -> tuple[int, list[StepTiming]]:
    """The most rows (of probe_rows) whose decode step takes at most the step budget of the target ITL
    (step_budget_ms), with every timing taken; stops at the first count past it. One row at least,
    whatever it takes."""
    budget = step_budget_ms(target_itl_ms)
    chosen = 1
    timings: list[StepTiming] = []
    for rows in probe_rows(ceiling):
        timing = StepTiming(rows, step_ms(rows))
        timings.append(timing)
        if timing.step_ms > budget:
            middle = (chosen + rows) // 2  # between the last count within the budget and this one
            if middle > chosen:
                between = StepTiming(middle, step_ms(middle))
                timings.append(between)
                if between.step_ms <= budget:
                    chosen = middle
            break
        chosen = rows
    return chosen, timings


def gpu_memory(host_index: str, run: Callable[..., Any] = subprocess.run) -> tuple[int, int] | None:
    """(total, free) bytes of the host's GPU `host_index`, from nvidia-smi; None when it cannot tell."""
    command = [
        "nvidia-smi",
        "--query-gpu=memory.total,memory.free",
        "--format=csv,noheader,nounits",
        f"--id={host_index}",
    ]
    try:
        result = run(command, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    try:
        total, free = (int(part.strip()) * 2**20 for part in result.stdout.strip().split(","))
    except ValueError:
        return None
    return total, free


def weights_bytes(model_dir: Path) -> int:
    """The size of the model's ONNX files (what loading it takes from the device)."""
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file() and ".onnx" in f.name)
