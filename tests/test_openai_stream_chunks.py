"""An OpenAI stream writes what one read of its jobs' streams brought in one piece, not one per token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from common.events import done_entry, status_entry, token_entry
from common.wire import JobStatus, Usage
from gateway.openai_api.chat import ChatFormat
from gateway.openai_api.choices import ChoiceEvent, Choices
from gateway.openai_api.completions import CompletionFormat
from gateway.openai_api.streaming import DONE, TextFrames, chunks, frame
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


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=0, max_size=12), index=st.integers(min_value=0, max_value=3))
def test_a_text_chunk_is_byte_for_byte_what_its_chunk_model_serializes_to(text: str, index: int) -> None:
    """Text chunks are made from a template per choice; they must equal the model's own JSON, for any
    text: quotes, backslashes, control characters, non-ASCII."""
    for form in (ChatFormat("chatcmpl-1", 7, "m", 4), CompletionFormat("cmpl-1", 7, "m")):
        text_frame = TextFrames(form)
        text_frame(index, "warm")  # the template is made on a choice's first chunk: use it after
        assert text_frame(index, text) == frame(form.text(index, text))
