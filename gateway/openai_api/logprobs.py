"""A choice's token log-probabilities, from its token events (common/events.py's entries, in the chat
shape) to OpenAI's two answers: chat's `logprobs.content` and text completions' parallel lists."""

from __future__ import annotations

from typing import Any

from gateway.openai_api.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob


def chat_logprobs(entries: list[dict[str, Any]] | None) -> ChatLogprobs | None:
    if entries is None:
        return None
    return ChatLogprobs(content=[TokenLogprob.model_validate(entry) for entry in entries])


class TextOffsets:
    """Where each token of a choice starts in its text, in characters: a token that completes a
    character another began counts from where that character starts."""

    def __init__(self) -> None:
        self._bytes = bytearray()

    def next(self, token_bytes: list[int]) -> int:
        offset = len(self._bytes.decode("utf-8", "ignore"))
        self._bytes += bytes(token_bytes)
        return offset


def completion_logprobs(
    entries: list[dict[str, Any]] | None, offsets: TextOffsets
) -> CompletionLogprobs | None:
    """`offsets`: the choice's, over every token before these."""
    if entries is None:
        return None
    return CompletionLogprobs(
        tokens=[entry["token"] for entry in entries],
        token_logprobs=[entry["logprob"] for entry in entries],
        top_logprobs=[
            None
            if entry["top_logprobs"] is None
            else {top["token"]: top["logprob"] for top in entry["top_logprobs"]}
            for entry in entries
        ],
        text_offset=[offsets.next(entry["bytes"]) for entry in entries],
    )
