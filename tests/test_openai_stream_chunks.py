"""An OpenAI stream writes what one read of its jobs' streams brought in one piece, not one per token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from common.events import done_entry, status_entry, token_entry
from common.wire import JobStatus, Usage
from gateway.openai_api.chat import ChatFormat
from gateway.openai_api.choices import ChoiceEvent, Choices
from gateway.openai_api.streaming import DONE, chunks
from gateway.sse import KEEPALIVE


def payloads(piece: bytes) -> list[dict[str, Any]]:
    frames = [frame for frame in piece.split(b"\n\n") if frame.startswith(b"data: {")]
    return [json.loads(frame.removeprefix(b"data: ")) for frame in frames]


async def test_each_read_of_the_jobs_streams_goes_out_as_one_piece_and_a_quiet_one_as_a_keep_alive() -> None:
    choices = Choices(None, "m", ["job_a"], [0], "messages")  # type: ignore[arg-type]  # needs no state here
    usage = Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6)

    async def reads() -> AsyncIterator[list[ChoiceEvent]]:
        yield [ChoiceEvent(0, token_entry(text, [i], i)) for i, text in enumerate(["a", "b", "c"])]
        yield []  # nothing came within the keep-alive interval
        yield [ChoiceEvent(0, done_entry(JobStatus.succeeded, "stop", usage.model_dump_json()))]

    started = [ChoiceEvent(0, status_entry(JobStatus.running, prompt_tokens=3))]
    form = ChatFormat("chatcmpl-1", 0, "m", 1)
    pieces = [piece async for piece in chunks(choices, started, reads(), form, include_usage=True)]

    assert len(pieces) == 5
    assert [p["choices"][0]["delta"] for p in payloads(pieces[0])] == [{"role": "assistant", "content": ""}]
    assert [p["choices"][0]["delta"]["content"] for p in payloads(pieces[1])] == ["a", "b", "c"]
    assert pieces[2] == KEEPALIVE
    assert [p["choices"][0]["finish_reason"] for p in payloads(pieces[3])] == ["stop"]
    assert payloads(pieces[4])[0]["usage"] == usage.model_dump() and pieces[4].endswith(DONE)
