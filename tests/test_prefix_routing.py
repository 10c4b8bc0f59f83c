"""Routing by prefix on real processes: a chat's next turn goes to the worker that holds the KV of its
first turn (common/prefix_hints.py), and never waits for that worker longer than the setting says."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common.registry import live_workers
from tests.conftest import Fleet, keys
from tests.jobs_client import submit, wait_done

# One gateway for the module's tests; each starts the workers of a model of its own, so that no hint of
# another test's prompts is ever on its model.
pytestmark = pytest.mark.module_fleet

DOCUMENT = " ".join(["one two three four five six seven eight"] * 11)  # about 300 tokens on the tiny model


def conversation(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Record {k}. {DOCUMENT}"}]


async def run(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], **extra: Any
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    job = await submit(client, body)
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded", done
    return done


def follow_up(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


async def test_a_next_turn_goes_to_the_worker_that_holds_its_first_turn(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    workers = [fleet.start_worker(model_name), fleet.start_worker(model_name)]
    firsts = []
    for k in range(4):  # first turns on each worker in turn: the other is stopped meanwhile
        idle = workers[(k + 1) % 2]
        idle.pause()
        try:
            firsts.append(await run(client, model_name, conversation(k)))
        finally:
            idle.resume()
        assert str(workers[k % 2].process.pid) in firsts[-1]["worker"]
        assert firsts[-1]["usage"]["prompt_tokens"] > 256
    for k, first in enumerate(firsts):  # both workers free: each next turn finds its own
        second = await run(client, model_name, follow_up(conversation(k), first["output"]))
        assert second["worker"] == first["worker"]
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}


async def test_a_next_turn_waits_for_a_stopped_worker_only_the_routing_wait(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    holder = fleet.start_worker(model_name)
    first = await run(client, model_name, conversation(0))
    other = fleet.start_worker(model_name)
    holder.pause()  # registered, with free slots, but it claims nothing
    try:
        second = await run(client, model_name, follow_up(conversation(0), first["output"]))
    finally:
        holder.resume()
    assert second["worker"] != first["worker"] and str(other.process.pid) in second["worker"]
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["timings"]["queue_wait_s"] >= 0.9  # it waited for the holder (1 s by default)


async def test_a_next_turn_is_never_routed_by_the_prompt_of_another_cache_scope(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    holder = fleet.start_worker(model_name)
    first = await run(client, model_name, conversation(0), cache_salt="one")
    other = fleet.start_worker(model_name)
    holder.pause()
    try:
        second = await run(client, model_name, follow_up(conversation(0), first["output"]), cache_salt="two")
    finally:
        holder.resume()
    assert str(other.process.pid) in second["worker"]
    assert second["timings"]["queue_wait_s"] < 0.9  # no hint of its scope: it waited for no worker


async def test_a_dead_workers_hints_are_ignored_once_its_heartbeat_runs_out(
    fleet: Fleet, client: httpx.AsyncClient, redis: Redis, model_name: str
) -> None:
    holder = fleet.start_worker(model_name)
    first = await run(client, model_name, conversation(0))
    fleet.start_worker(model_name)
    holder.kill()

    async def holder_gone() -> bool:
        return all(w["id"] != first["worker"] for w in await live_workers(redis, keys))

    deadline = asyncio.get_running_loop().time() + 30
    while not await holder_gone():  # its registry entry lives until its heartbeat runs out
        assert asyncio.get_running_loop().time() < deadline, "the killed worker left the registry"
        await asyncio.sleep(0.2)
    second = await run(client, model_name, follow_up(conversation(0), first["output"]))
    assert second["worker"] != first["worker"]
    assert second["timings"]["queue_wait_s"] < 0.9  # not held for the dead holder
