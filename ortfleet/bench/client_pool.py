"""Closed-loop clients spread over several processes: at tens of thousands of tokens a second, one Python
process parsing every streamed chunk would measure itself rather than the server."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from typing import Any

from common import aio
from ortfleet.bench.completions import Planned, Served, closed_loop

_START_TIMEOUT_S = 120.0


def pooled_closed_loop(
    url: str, model: str | Sequence[str], planned: list[Planned], concurrency: int, processes: int
) -> tuple[list[Served], float]:
    """`concurrency` closed-loop clients in `processes` processes, each with its share of the clients and
    every processes-th request, starting together once all have started; the wall time runs from the
    first request's send to the last one's end (perf_counter is one monotonic clock in every process).
    Each process's clients are numbered from its index times `concurrency`, so no two share a number. With a
    list of models, the i-th client of all (in process order) names the i-th, modulo its length
    (closed_loop)."""
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return aio.run(closed_loop(url, model, planned, concurrency))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    outcomes: Any = context.Queue()
    clients = [(concurrency + i) // processes for i in range(processes)]
    models = [model] if isinstance(model, str) else list(model)
    children = []
    for i in range(processes):
        first = sum(clients[:i])  # its clients' place among all clients
        own = [models[(first + j) % len(models)] for j in range(clients[i])]
        children.append(
            context.Process(
                target=_one_process,
                args=(url, own, planned[i::processes], clients[i], i * concurrency, barrier, outcomes),
                daemon=True,
            )
        )
    for child in children:
        child.start()
    results: list[Served] = []
    try:
        for _ in children:
            error, served = outcomes.get()
            if error is not None:
                raise RuntimeError(f"a client process failed: {error}")
            results += served
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    if not results:
        return [], 0.0
    return results, max(r.end for r in results) - min(r.start for r in results)


def _one_process(
    url: str,
    model: list[str],
    planned: list[Planned],
    clients: int,
    first_stream: int,
    barrier: Barrier,
    outcomes: Any,
) -> None:
    try:
        barrier.wait(_START_TIMEOUT_S)
        results, _ = aio.run(closed_loop(url, model, planned, clients, first_stream))
    except BaseException as e:
        outcomes.put((f"{type(e).__name__}: {e}", []))
        return
    outcomes.put((None, results))
