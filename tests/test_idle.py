"""An idle fleet's processes sleep until something happens: no timer wakes them many times a second, and
what they wait for (a signal, a scrape, a new batch) still gets an answer at once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.main import CalmServer
from ortfleet.bench.machine import wakeups
from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet, RedisServer
from tests.test_batches import line, until_status, upload
from worker.metrics import MetricsServer, serve


def voluntary_switches(thread: threading.Thread) -> int:
    """How many times the thread has gone to sleep (and so been woken) so far."""
    assert thread.native_id is not None
    return wakeups(os.getpid(), thread.native_id)


@pytest.mark.unit
def test_the_worker_metrics_thread_sleeps_until_a_scrape_comes_and_stops_at_once() -> None:
    registry = CollectorRegistry()
    Counter("ortfleet_idle_probe", "a metric to scrape", registry=registry).inc()
    server, thread = serve(registry, "127.0.0.1", 0)
    metrics = MetricsServer(server, thread, "")
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        assert "ortfleet_idle_probe_total 1.0" in httpx.get(url).text
        before = voluntary_switches(thread)
        time.sleep(0.5)  # the idle spell measured: a thread polling every 0.05 s would wake 10 times
        assert voluntary_switches(thread) - before <= 1
        for _ in range(3):  # and it still answers each scrape
            assert httpx.get(url).status_code == 200
    finally:
        started = time.monotonic()
        metrics.close()
    assert not thread.is_alive()
    assert time.monotonic() - started < 0.5


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


class CountedTicks(CalmServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


@pytest.mark.unit
async def test_the_gateway_server_ticks_once_a_second_and_a_signal_stops_it_at_once() -> None:
    port = free_port()
    app = Starlette(routes=[Route("/", hello)])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = CountedTicks(config)
    serving = asyncio.create_task(server.serve())
    async with httpx.AsyncClient() as client:
        while not server.started:  # uvicorn has no event for it
            assert not serving.done(), "the server did not start"
            await asyncio.sleep(0.01)
        reply = await client.get(f"http://127.0.0.1:{port}/")
        assert reply.text == "hello" and reply.headers["date"].endswith("GMT")
        ticks = server.ticks
        await asyncio.sleep(1.5)  # the idle spell measured: uvicorn's own loop ticks 15 times in it
        assert server.ticks - ticks <= 2
    started = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what a SIGTERM calls
    server._captured_signals.clear()  # uvicorn would raise it again in this process once stopped
    await asyncio.wait_for(serving, 5)
    assert time.monotonic() - started < 0.5  # well within the 1 s between ticks


@pytest.fixture
def slow_driver_fleet(
    redis_server: RedisServer, tiny_model: Path, model_name: str
) -> Iterator[openai.OpenAI]:
    """A gateway whose batch driver, with no batch active, rests 10 ticks of 10 s between looks."""
    fleet = Fleet(redis_server.url, tiny_model, env={"ORTFLEET_BATCH_TICK_S": "10"})
    fleet.start_gateway()
    fleet.start_worker(model_name)
    sdk = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0)
    yield sdk
    sdk.close()
    fleet.stop_all()


async def test_a_batch_created_while_the_driver_rests_is_taken_up_at_once(
    slow_driver_fleet: openai.OpenAI, model_name: str
) -> None:
    sdk = slow_driver_fleet
    input_file = upload(sdk, [line("only", model_name, "Hello")])
    batch = await asyncio.to_thread(
        sdk.batches.create, input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # Validated by the driver's first step: at once, not after its 100 s rest (nor a 10 s tick).
    started = await until_status(sdk, batch.id, "in_progress", timeout_s=5)
    assert started.request_counts is not None and started.request_counts.total == 1
