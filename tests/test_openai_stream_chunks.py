"""An OpenAI stream writes what one read of its jobs' streams brought in one piece, not one per token."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from common.events import done_entry, status_entry, token_entry
from common.jobs.reads import stage_jobs
from common.jobs.record import JobRecord
from common.stores import Store
from common.wire import JobStatus, Usage
from gateway.metrics import GatewayMetrics
from gateway.openai_api.chat import ChatFormat
from gateway.openai_api.choices import ChoiceEvent, Choices
from gateway.openai_api.completions import CompletionFormat
from gateway.openai_api.streaming import DONE, ChunkStream, PushedChunks, TextFrames, chunk_frame, chunks
from gateway.stopping import Stopping
from gateway.streaming.relay import StreamRelay
from gateway.streaming.sse import KEEPALIVE
from tests.conftest import RedisServer, keys
from tests.stalled_client import TOKENS, USAGE, StallingBody, stall_mid_stream


def payloads(piece: bytes) -> list[dict[str, Any]]:
    frames = [frame for frame in piece.split(b"\n\n") if frame.startswith(b"data: {")]
    return [json.loads(frame.removeprefix(b"data: ")) for frame in frames]


@pytest.mark.unit
async def test_each_read_of_the_jobs_streams_goes_out_as_one_piece_and_a_quiet_one_as_a_keep_alive() -> None:
    choices = Choices(None, "m", ["job_a"], [0], "messages")  # type: ignore[arg-type]  # needs no state here
    usage = Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6)

    async def reads() -> AsyncIterator[list[ChoiceEvent]]:
        yield [ChoiceEvent(0, token_entry(text, [i], i)) for i, text in enumerate(["a", "b", "c"])]
        yield []  # nothing came within the keep-alive interval
        yield [ChoiceEvent(0, done_entry(JobStatus.succeeded, "stop", usage.model_dump_json()))]

    started = [ChoiceEvent(0, status_entry(JobStatus.running, prompt_tokens=3))]
    form = ChatFormat("chatcmpl-1", 0, "m", 1)
    stream = ChunkStream(choices, form, include_usage=True)
    pieces = [piece async for piece in chunks(stream, started, reads())]

    assert len(pieces) == 5
    assert [p["choices"][0]["delta"] for p in payloads(pieces[0])] == [{"role": "assistant", "content": ""}]
    assert [p["choices"][0]["delta"]["content"] for p in payloads(pieces[1])] == ["a", "b", "c"]
    assert pieces[2] == KEEPALIVE
    assert [p["choices"][0]["finish_reason"] for p in payloads(pieces[3])] == ["stop"]
    assert payloads(pieces[4])[0]["usage"] == usage.model_dump() and pieces[4].endswith(DONE)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=0, max_size=12), index=st.integers(min_value=0, max_value=3))
def test_a_text_chunk_is_byte_for_byte_what_its_chunk_model_serializes_to(text: str, index: int) -> None:
    """Text chunks are made from a template per choice; they must equal the model's own JSON, for any
    text: quotes, backslashes, control characters, non-ASCII."""
    for form in (ChatFormat("chatcmpl-1", 7, "m", 4), CompletionFormat("cmpl-1", 7, "m")):
        text_frame = TextFrames(form)
        text_frame(index, "warm")  # the template is made on a choice's first chunk: use it after
        assert text_frame(index, text) == chunk_frame(form.text(index, text))


def pushed_choices(relay: StreamRelay, redis: Redis, job_ids: list[str]) -> Choices:
    """The jobs of one completion request, on the test's Redis and relay."""
    metrics = GatewayMetrics()
    shard = SimpleNamespace(relay=relay, redis=redis, keys=keys)
    state = SimpleNamespace(
        shards=SimpleNamespace(of_model=lambda model: shard), metrics=metrics, stopping=Stopping()
    )
    return Choices(state, "m", job_ids, [0] * len(job_ids), "prompt")  # type: ignore[arg-type]


async def test_a_pushed_stream_stops_writing_to_a_stalled_client_then_sends_every_token_once(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Chunks go out from the relay's callback. Once the client's connection backs up, the stream stops
    taking entries, and when the client reads again it reads on from Redis: no token lost or repeated."""
    job_id = "pushed_" + secrets.token_hex(4)
    running = JobRecord(id=job_id, model="m", status=JobStatus.running, created_at=0, attempts=1)
    await stage_jobs(redis, keys, [running])
    stream_key = keys.events(job_id)
    relay = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=4)
    await relay.start()
    try:
        choices = pushed_choices(relay, redis, [job_id])
        events = choices.events(30)
        seen = await choices.wait_started(events, 10)
        body = StallingBody()
        stream = ChunkStream(choices, CompletionFormat("cmpl-1", 0, "m"), include_usage=True)
        writing = asyncio.create_task(PushedChunks(body, stream, events, 30).run(seen))

        def texts() -> list[str]:  # of the text chunks written (not the finish or usage chunks)
            chunks = [c["choices"][0] for piece in body.written for c in payloads(piece) if c["choices"]]
            return [choice["text"] for choice in chunks if choice["finish_reason"] is None]

        pauses = choices.state.metrics.sse_client_pauses._value.get
        await stall_mid_stream(redis, relay, stream_key, body, texts, pauses, writing)
    finally:
        await events.aclose()
        await relay.close()
    assert texts() == TOKENS
    assert body.written[-1].endswith(DONE) and payloads(body.written[-1])[-1]["usage"] == USAGE.model_dump()
