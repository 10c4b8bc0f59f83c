"""What serving LoRA adapters costs the CPU batcher: 8 greedy streams mixing 3 adapters and the base model
against 8 streams of the base model alone, on engines in this process (no Redis, gateway or HTTP).

`python -m ortfleet.bench.lora_mix [--model DIR] [--streams 8] [--tokens 128] [--rank 16] [--rounds 3]
[--targets q_proj,v_proj] [--json FILE]` writes 3 random adapters for the model (PEFT's files; every
projection of every layer unless --targets names modules), opens an engine without adapters and one with
them, and runs, in turns, `rounds` times each:
- base: the streams on the engine without adapters (today's graph);
- base, adapters loaded: the same streams on the engine with adapters, every row the base model's;
- mixed: on that engine, stream i uses adapter i mod 4 (the fourth: the base model).
It also times loading the adapters at run time, one after another, into an engine started without any
(`BatchingEngine.load_adapter`; the first brings a new session, rewritten for its projections).
Each stream generates exactly `tokens` tokens; a figure is all streams' tokens over the wall time, the
median of the rounds, so that runs on a shared machine are compared in the same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.machine import describe
from ortfleet.bench.report import write_json
from worker.engine import GenerationRequest
from worker.engines.batcher.engine import BatchingEngine
from worker.engines.batcher.lora_graph import LoraGraph

ADAPTERS = ("first", "second", "third")
_BLOCKS = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(
    folder: Path, graph: LoraGraph, rank: int, seed: int, targets: tuple[str, ...] = ()
) -> Path:
    """A random LoRA adapter on the `targets` modules (all: every projection) of `graph`, in PEFT's files."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for p in graph.projections:
        for part in p.parts:
            if targets and part.module not in targets:
                continue
            block = _BLOCKS.get(part.module, "self_attn")
            key = f"base_model.model.model.layers.{p.layer}.{block}.{part.module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, p.in_features**-0.5, (rank, p.in_features))
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (part.width, rank))
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.size * 4
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "adapter_model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            out.write(tensor.astype("<f4").tobytes())
    modules = sorted({key.split(".")[-3] for key in tensors})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


async def tokens_per_s(engine: BatchingEngine, adapters: list[str | None], tokens: int) -> float:
    """All streams at once, each exactly `tokens` tokens: their tokens over the wall time."""
    requests = [
        GenerationRequest(engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), tokens, tokens, adapter=adapter)
        for i, adapter in enumerate(adapters)
    ]
    began = time.perf_counter()
    counted = 0
    for stream in engine.submit(requests):
        while True:
            update = await stream.updates.get()
            counted += len(update.token_ids)
            if update.finish is not None:
                if update.error:
                    raise RuntimeError(update.error)
                break
    return counted / (time.perf_counter() - began)


async def load_times(model_dir: Path, adapters: dict[str, Path]) -> list[float]:
    """Seconds each adapter took to load at run time, in turn, into an idle engine started without any."""
    engine = BatchingEngine(model_dir, slots=1)
    times = []
    try:
        for name, folder in adapters.items():
            began = time.perf_counter()
            await engine.load_adapter(name, folder)
            times.append(time.perf_counter() - began)
    finally:
        engine.close()
    return times


async def measure(
    model_dir: Path, streams: int, tokens: int, rank: int, rounds: int, targets: tuple[str, ...] = ()
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        graph = LoraGraph(model_dir)
        adapters = {
            name: write_random_adapter(Path(folder) / name, graph, rank, seed, targets)
            for seed, name in enumerate(ADAPTERS)
        }
        loads = await load_times(model_dir, adapters)
        base = BatchingEngine(model_dir, slots=streams)
        lora = BatchingEngine(model_dir, slots=streams, adapters=adapters)
    mixed: list[str | None] = [(*ADAPTERS, None)[i % (len(ADAPTERS) + 1)] for i in range(streams)]
    alone: list[str | None] = [None] * streams
    runs: dict[str, list[float]] = {"base": [], "base_adapters_loaded": [], "mixed": []}
    try:
        for engine in (base, lora):  # the first runs touch the KV slots' pages: not measured
            await tokens_per_s(engine, mixed if engine is lora else alone, tokens)
        for _ in range(rounds):
            runs["base"].append(await tokens_per_s(base, alone, tokens))
            runs["base_adapters_loaded"].append(await tokens_per_s(lora, alone, tokens))
            runs["mixed"].append(await tokens_per_s(lora, mixed, tokens))
    finally:
        base.close()
        lora.close()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {
        "model": str(model_dir),
        "streams": streams,
        "tokens": tokens,
        "rank": rank,
        "targets": list(targets) or "all",
        "adapters": len(ADAPTERS),
        "tokens_per_s": {name: round(value, 1) for name, value in medians.items()},
        "rounds": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "mixed_over_base": round(medians["mixed"] / medians["base"], 3),
        "runtime_load_s": [round(took, 3) for took in loads],
        "machine": describe(),
    }


def main(argv: list[str] | None = None) -> None:
    from common.model_folder import default_model_dir
    from common.settings import FleetSettings

    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.lora_mix", description=__doc__)
    parser.add_argument("--model", type=Path, help="the model folder (default: the default model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="generated by each stream")
    parser.add_argument("--rank", type=int, default=16, help="each adapter's rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--targets", default="", help="the adapters' modules, comma-separated (default: all)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    model_dir = args.model or default_model_dir(FleetSettings().model_cache)
    targets = tuple(filter(None, args.targets.split(",")))
    figures = asyncio.run(measure(model_dir, args.streams, args.tokens, args.rank, args.rounds, targets))
    speeds = figures["tokens_per_s"]
    print(
        f"{args.streams} streams x {args.tokens} tokens, {len(ADAPTERS)} adapters of rank {args.rank} on "
        f"{args.targets or 'every projection'}: "
        f"base {speeds['base']} tokens/s, base with adapters loaded {speeds['base_adapters_loaded']}, "
        f"mixed {speeds['mixed']} ({figures['mixed_over_base']}x base); loaded at run time in turn: "
        + ", ".join(f"{took:.2f} s" for took in figures["runtime_load_s"])
        + " (the first with a new session)"
    )
    if args.json:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
