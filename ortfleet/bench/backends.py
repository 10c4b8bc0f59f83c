"""The two sides of the overhead benchmark: the engine in-process (direct) and the fleet over HTTP/SSE."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ortfleet.bench.http import Connection

if TYPE_CHECKING:
    from worker.engines.batcher.engine import BatchingEngine
    from worker.engines.ort_engine import OrtEngine

FLEET_APIS = ("jobs", "completions", "responses")

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five ideas for a weekend trip near the mountains, with one sentence on each.",
    "What is the capital of France? Answer, then describe the city in a few sentences.",
    "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup, step by step.",
    "Why is the sky blue? Explain the physics briefly but precisely.",
    "Summarise the plot of a detective novel you would like to read, in one paragraph.",
)


@dataclass
class RequestResult:
    start: float
    end: float
    ttft: float
    tokens: int
    gaps: list[float] = field(default_factory=list)  # per token after the first, seconds
    batch_rows: int | None = None  # most requests the engine generated together during this one
    job_id: str | None = None
    # A fleet job's own timings (its record, from the gateway's and the worker's clocks): submission to
    # the worker taking it, and submission to the worker receiving its first token from the engine.
    queue_wait: float | None = None
    worker_ttft: float | None = None


class Timeline:
    """Records one request's token arrivals: TTFT, and inter-token gaps spread over each arrival."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.tokens = 0
        self.gaps: list[float] = []
        self._last = self.start

    def arrived(self, count: int, at: float) -> None:
        if count <= 0:
            return
        if self.ttft is None:
            self.ttft = at - self.start
            self.gaps += [0.0] * (count - 1)  # tokens that came with the first one: no wait
        else:
            self.gaps += [(at - self._last) / count] * count
        self.tokens += count
        self._last = at

    def result(self, batch_rows: int | None = None, job_id: str | None = None) -> RequestResult:
        if self.ttft is None:
            raise RuntimeError("the request produced no token")
        end = time.perf_counter()
        return RequestResult(self.start, end, self.ttft, self.tokens, self.gaps, batch_rows, job_id)


class Backend(Protocol):
    name: str

    async def client(self) -> Callable[[str], Awaitable[RequestResult]]:
        """A new client: a function that runs one request to its end."""
        ...

    async def close_clients(self) -> None: ...


def open_worker_engine(
    model_dir: Path, device: str = "auto", kv_fraction: float | None = None
) -> OrtEngine | BatchingEngine:
    """The engine a worker on `device` runs the model with, with the worker's settings from the
    environment (ORTFLEET_*), in this process; `kv_fraction`: its share of a GPU's memory for its KV
    cache, as a worker sharing the card gets (ORTFLEET_GPU_KV_FRACTION)."""
    import onnxruntime_genai as og

    from common.worker_settings import WorkerSettings
    from worker.engines.device import parse_device
    from worker.engines.engine_choice import open_engine

    settings = WorkerSettings()
    if kv_fraction is not None:
        settings = settings.model_copy(update={"gpu_kv_fraction": kv_fraction})
    return open_engine(model_dir, parse_device(device, og.is_cuda_available), settings)


class DirectBackend:
    """The worker's engine in this process; requests made in the same event-loop turn are submitted
    together, as a worker submits the jobs it claims together."""

    name = "direct"

    def __init__(
        self, model_dir: Path, max_tokens: int, device: str = "auto", kv_fraction: float | None = None
    ) -> None:
        self.engine = open_worker_engine(model_dir, device, kv_fraction)
        self.max_tokens = max_tokens
        self._pending: list[tuple[Any, asyncio.Future[Any]]] = []

    async def client(self) -> Callable[[str], Awaitable[RequestResult]]:
        return self.generate

    async def close_clients(self) -> None:
        return None

    def close(self) -> None:
        self.engine.close()

    async def generate(self, prompt: str) -> RequestResult:
        from worker.engine import GenerationRequest

        timeline = Timeline()
        ids = self.engine.tokenizer.encode(prompt)  # the worker tokenizes inside the fleet's TTFT too
        request = GenerationRequest(ids, max_new_tokens=self.max_tokens, min_new_tokens=self.max_tokens)
        stream = await self._submit(request)
        rows = 0
        while True:
            update = await stream.updates.get()
            timeline.arrived(len(update.token_ids), time.perf_counter())
            rows = max(rows, update.batch_rows)
            if update.finish is not None:
                if update.error:
                    raise RuntimeError(update.error)
                return timeline.result(batch_rows=rows)

    def _submit(self, request: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((request, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        streams = self.engine.submit([request for request, _ in pending])
        for (_, future), stream in zip(pending, streams, strict=True):
            future.set_result(stream)


class FleetBackend:
    """The fleet over HTTP, one keep-alive connection per client, through one of FLEET_APIS: a job
    (POST /v1/jobs, then its SSE stream), a streamed text completion (OpenAI's chunks) or a streamed
    response (OpenAI's Responses events)."""

    name = "fleet"

    def __init__(self, url: str, model: str, max_tokens: int, api: str = "jobs") -> None:
        if api not in FLEET_APIS:
            raise ValueError(f"api: one of {', '.join(FLEET_APIS)}, not {api!r}")
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.api = api
        self._connections: list[Connection] = []

    async def client(self) -> Callable[[str], Awaitable[RequestResult]]:
        connection = Connection(self.url)
        self._connections.append(connection)

        async def generate(prompt: str) -> RequestResult:
            return await self.generate(connection, prompt)

        return generate

    async def close_clients(self) -> None:
        for connection in self._connections:
            await connection.close()
        self._connections.clear()

    async def generate(self, connection: Connection, prompt: str) -> RequestResult:
        if self.api == "responses":
            return await self._response(connection, prompt)
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens}
        body["min_tokens"] = self.max_tokens
        if self.api == "completions":
            return await self._completion(connection, body)
        timeline = Timeline()
        job = await connection.json("POST", "/v1/jobs", body, expect=202)
        async for event in connection.events(job["links"]["events"]):
            if event.event == "token":
                timeline.arrived(len(json.loads(event.data)["token_ids"]), event.received)
            elif event.event == "error":
                raise RuntimeError(f"job {job['id']} failed: {event.data}")
        return timeline.result(job_id=job["id"])

    async def _completion(self, connection: Connection, body: dict[str, Any]) -> RequestResult:
        """A streamed text completion: a chunk with text is a token's arrival (stream interval 1); the
        usage chunk at the end gives the true count (a token whose text waits for the next one sends
        no chunk). A completion whose tokens carried no text at all arrives with its finish chunk."""
        timeline = Timeline()
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        completion_id = ""
        async for event in connection.events("/v1/completions", body):
            if event.data == "[DONE]":
                continue  # the body's end follows: read it, so the connection can take the next request
            chunk = json.loads(event.data)
            if "error" in chunk:
                raise RuntimeError(f"completion {completion_id} failed: {event.data}")
            completion_id = chunk["id"]
            choice = chunk["choices"][0] if chunk["choices"] else None
            if choice and (choice["text"] or (choice["finish_reason"] and timeline.ttft is None)):
                timeline.arrived(1, event.received)
            if chunk.get("usage"):
                timeline.tokens = chunk["usage"]["completion_tokens"]
        return timeline.result(job_id=completion_id.removeprefix("cmpl-"))

    async def _response(self, connection: Connection, prompt: str) -> RequestResult:
        """A streamed response, greedy: a text delta is a token's arrival, the final response's usage
        gives the count (a response with no text arrives with its final event). Its input is a chat
        message and the Responses API has no `min_tokens`, so the work differs from the direct run's
        (the chat template's tokens; a response may end early)."""
        timeline = Timeline()
        body = {
            "model": self.model,
            "input": prompt,
            "max_output_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        response_id = ""
        async for event in connection.events("/v1/responses", body):
            data = json.loads(event.data)
            kind = data["type"]
            if kind == "response.created":
                response_id = data["response"]["id"]
            elif kind == "response.output_text.delta":
                timeline.arrived(1, event.received)
            elif kind in ("response.completed", "response.incomplete"):
                if timeline.ttft is None:
                    timeline.arrived(1, event.received)
                timeline.tokens = data["response"]["usage"]["output_tokens"]
            elif kind == "response.failed":
                raise RuntimeError(f"response {response_id} failed: {event.data}")
        return timeline.result(job_id="job_" + response_id.removeprefix("resp_"))
