"""The gateway's app behind a stock uvicorn, whose HTTP protocol has none of the gateway's extensions
(the direct body, the departure callback): job, OpenAI and Responses streams then run as generators,
and must say all that they say behind the gateway's own protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from common.gateway_settings import GatewaySettings
from gateway.app import build_app
from ortfleet.fleet.processes import free_port
from tests.conftest import RedisServer
from tests.fake_workers import Started
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.waiting import until
from worker.engines.fake_engine import FakeEngine


@dataclass
class StockServer:
    url: str
    model: str


@pytest.fixture
async def stock(redis_server: RedisServer, start_worker: Started, model: str) -> AsyncIterator[StockServer]:
    """The app served by uvicorn's own protocol in the test's loop, and a fake-engine worker."""
    start_worker(model, FakeEngine(0.002, 4))
    port = free_port()
    app = build_app(GatewaySettings(redis_url=redis_server.url, sse_keepalive_s=1))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or serving.done(), "uvicorn listening", 20)
        assert server.started
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            for _ in range(200):  # until the worker's registration is seen
                if model in [m["id"] for m in (await http.get("/v1/models")).json()["data"]]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"no worker of {model} in /v1/models within 10 s")
        yield StockServer(f"http://127.0.0.1:{port}", model)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 20)


async def test_a_job_stream_behind_a_stock_server_sends_every_token_and_ends(stock: StockServer) -> None:
    async with httpx.AsyncClient(base_url=stock.url, timeout=30) as http:
        job = await submit(http, {"model": stock.model, "prompt": "Hi", "max_tokens": 12})
        events = await read_events(http, job["id"])
        done = await wait_done(http, job["id"])
        resumed = await read_events(http, job["id"], after=events[3].id)
    assert done["status"] == "succeeded"
    assert [e.data["index"] for e in events if e.event == "token"] == list(range(12))
    assert streamed_text(events) == done["output"] and len(done["output"]) == 12
    assert [e.id for e in resumed] == [e.id for e in events[4:]]


async def test_openai_and_responses_streams_behind_a_stock_server_match_their_unstreamed_answers(
    stock: StockServer,
) -> None:
    sdk = openai.AsyncOpenAI(base_url=stock.url + "/v1", api_key="none", max_retries=0)
    try:
        whole = await sdk.completions.create(model=stock.model, prompt="Hello", max_tokens=10)
        chunks = [
            chunk
            async for chunk in await sdk.completions.create(
                model=stock.model,
                prompt="Hello",
                max_tokens=10,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        events = [
            event
            async for event in await sdk.responses.create(
                model=stock.model, input="Hello", max_output_tokens=10, stream=True
            )
        ]
    finally:
        await sdk.close()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len(text) == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert len(deltas) == 10 and events[-1].response.output_text == deltas


async def test_a_foreground_response_whose_client_leaves_a_stock_server_is_cancelled(
    stock: StockServer,
) -> None:
    body = {"model": stock.model, "input": "Hello", "max_output_tokens": 4000, "stream": True}
    async with httpx.AsyncClient(base_url=stock.url, timeout=30) as http:
        async with http.stream("POST", "/v1/responses", json=body) as stream:
            assert stream.status_code == 200
            response_id = ""
            async for line in stream.aiter_lines():
                if line.startswith("data: ") and not response_id:
                    response_id = line.split('"id":"', 1)[1].split('"', 1)[0]
                if line == "event: response.output_text.delta":
                    break  # the client leaves mid-stream
        job_id = "job_" + response_id.removeprefix("resp_")
        job = await wait_done(http, job_id, timeout_s=20)
    assert job["status"] == "cancelled" and 0 < len(job["output"] or "") < 4000
