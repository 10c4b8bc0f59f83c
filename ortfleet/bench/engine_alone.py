"""The serving bench's baseline: the engine a worker on the device runs (ortfleet's batcher, or og.Engine
with the model's dynamic batching), alone in a process of its own, at each concurrency: closed-loop
clients hand it the same requests the server gets, with no Redis, gateway or HTTP between."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import aio
from ortfleet.bench.backends import PROMPTS, open_worker_engine
from ortfleet.bench.completions import Planned, Served, level_figures


def engine_alone(
    model_dir: Path, levels: list[tuple[int, list[Planned]]], device: str = "auto"
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`engine_in_this_process`, run in a child process: its engine's device memory (og.Engine keeps a
    GPU's KV cache until its process ends) is the card's again before the fleet's workers start."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(engine_in_this_process, model_dir, levels, device).result()


def engine_in_this_process(
    model_dir: Path, levels: list[tuple[int, list[Planned]]], device: str = "auto"
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The figures of each (concurrency, requests) level, as the server's levels give them
    (level_figures), on one engine opened once; and the engine's shape: its kind, its rows and, on a GPU,
    how they were sized from the card."""
    engine = open_worker_engine(model_dir, device)
    sizing = getattr(engine, "row_sizing", None)
    shape = {
        "pid": os.getpid(),  # of the process it ran in
        "engine": type(engine).__name__,
        "rows": engine.capacity,
        "row_sizing": sizing.as_dict() if sizing is not None else None,
    }
    try:
        return aio.run(_levels(engine, levels)), shape
    finally:
        engine.close()


async def _levels(engine: Any, levels: list[tuple[int, list[Planned]]]) -> list[dict[str, Any]]:
    warm = [Planned(-1 - i, PROMPTS[i], 8) for i in range(2)]
    await _closed_loop(engine, warm, 2)  # first requests pay for allocations, not measured
    figures = []
    for clients, planned in levels:
        results, wall = await _closed_loop(engine, planned, clients)
        figures.append({"concurrency": clients, **level_figures(results, wall)})
    return figures


async def _closed_loop(engine: Any, planned: list[Planned], clients: int) -> tuple[list[Served], float]:
    from worker.engine import GenerationRequest

    pending = iter(planned)
    results: list[Served] = []

    async def client(number: int) -> None:
        for request in pending:
            begun = time.perf_counter()
            ids = engine.tokenizer.encode(request.prompt)  # the worker tokenizes inside the TTFT too
            generation = GenerationRequest(
                ids, max_new_tokens=request.max_tokens, min_new_tokens=request.max_tokens
            )
            [stream] = engine.submit([generation])
            times: list[float] = []
            while True:
                update = await stream.updates.get()
                now = time.perf_counter()
                times += [now] * len(update.token_ids)
                if update.finish is not None:
                    if update.error:
                        raise RuntimeError(f"request {request.index}: {update.error}")
                    break
            if not times:
                raise RuntimeError(f"request {request.index} produced no token")
            gaps = [b - a for a, b in itertools.pairwise(times)]
            results.append(
                Served(
                    request.index,
                    request.max_tokens,
                    begun,
                    times[0] - begun,
                    times[-1],
                    len(times),
                    gaps,
                    prompt_tokens=len(ids),
                    arrivals=times,
                    stream=number,
                )
            )

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    return results, time.perf_counter() - started
