"""Tokenize and detokenize calls that the gateway hands to a worker of the model through Redis.

A worker answers with the tokenizer it generates with, so every gateway gives the same ids as the
fleet's workers without having the model's files.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from common.wire import ChatMessage

REPLY_TTL_S = 30


class TokenizerCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    op: Literal["tokenize", "detokenize"]
    deadline: float  # wall clock; a worker skips a call whose caller has given up
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tokens: list[int] | None = None


class TokenizerReply(BaseModel):
    tokens: list[int] | None = None
    text: str | None = None
    error: str | None = None
    param: str | None = None  # the field the error is about, when the worker can tell
