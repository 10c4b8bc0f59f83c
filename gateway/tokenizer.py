"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by a worker of the model.

The gateway has no model files; a live worker of the model answers through Redis with the tokenizer
it generates with, so every gateway replica gives the ids the fleet actually uses.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common import lua
from common.apikeys import Principal
from common.error_codes import ErrorCode
from common.keys import Keyspace
from common.tokenizer_calls import TokenizerCall, TokenizerReply
from common.wire import ChatMessage
from gateway.auth import principal_of
from gateway.errors import ApiError
from gateway.openai_api.params import job_messages
from gateway.openai_api.protocol import ChatMessageIn
from gateway.operations import OBJECT, Operation, Reply
from gateway.request_body import parse_body
from gateway.state import AppState, app_state
from gateway.submission import resolve_model

CALL_TIMEOUT_S = 10
BURST_S = 10  # a key may tokenize this many seconds' worth of its rate at once


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = Field(None, max_length=1_000_000)
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(..., max_length=1_000_000)


def _answered_by_a_worker(summary: str, request: type[BaseModel]) -> Operation:
    return Operation(
        f"{summary}, answered by a worker of the model",
        request=request,
        responses={200: Reply("ok", OBJECT)},
        errors=(400, 404, 503, 504),
    )


@_answered_by_a_worker("vLLM's: a prompt or chat messages as the model's token ids", TokenizeRequest)
async def tokenize(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, TokenizeRequest, invalid_status=400)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give exactly one of 'prompt' and 'messages'", param="prompt")
    messages: list[ChatMessage] | None = job_messages(body.messages) if body.messages else None
    model, context = await _model(state, body.model)
    chars = len(body.prompt) if body.prompt is not None else sum(len(m.content) for m in messages or [])
    await _charge(state, principal_of(request.scope), chars)
    reply = await _call(state, model, op="tokenize", prompt=body.prompt, messages=messages)
    tokens = reply.tokens or []
    return JSONResponse(
        {"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": None}
    )


@_answered_by_a_worker("vLLM's: token ids as text", DetokenizeRequest)
async def detokenize(request: Request) -> Response:
    state = app_state(request)
    body = await parse_body(request, DetokenizeRequest, invalid_status=400)
    model, _context = await _model(state, body.model)
    reply = await _call(state, model, op="detokenize", tokens=body.tokens)
    return JSONResponse({"prompt": reply.text or ""})


async def _model(state: AppState, requested: str | None) -> tuple[str, int]:
    try:
        served = await resolve_model(state, requested)
        return served.model, served.context_length
    except ApiError as e:  # vLLM's routes answer bad values with 400, as the OpenAI ones do
        if e.status != 422:
            raise
        raise ApiError(400, e.message, param=e.param, code=e.code) from e


async def _charge(state: AppState, principal: Principal, chars: int) -> None:
    """429 when the key has tokenized its characters per second (counted across gateways)."""
    rate = principal.tokenize_chars_per_s
    if not rate or chars <= 0:
        return
    wait_ms = await tokenize_budget_wait(
        state.redis,
        state.keys,
        key_name=principal.name,
        now_ms=int(time.time() * 1000),
        chars=chars,
        chars_per_s=rate,
    )
    if wait_ms:
        raise ApiError(
            429,
            f"key {principal.name!r} is over its /tokenize limit of {rate} characters per second "
            f"(ORTFLEET_KEY_TOKENIZE_CHARS_PER_S, {BURST_S} s of it at once): these {chars} characters fit "
            f"in {wait_ms / 1000:.1f} s",
            param="prompt",
            code=ErrorCode.tokenize_rate_exceeded,
            headers={"Retry-After": str(max(1, -(-wait_ms // 1000)))},
        )


async def tokenize_budget_wait(
    redis: Redis, keys: Keyspace, *, key_name: str, now_ms: int, chars: int, chars_per_s: int
) -> int:
    """scripts/tokenize_budget.lua: takes the characters from the key's budget and answers 0, or takes
    nothing and answers the ms until they would fit (a burst of BURST_S seconds' worth at most)."""
    script = lua.register(redis, __name__, "tokenize_budget.lua")
    args = [str(now_ms), str(chars), str(chars_per_s), str(BURST_S * 1000)]
    return int(await script(keys=[keys.tokenize_budget(key_name)], args=args))


async def _call(state: AppState, model: str, **fields: Any) -> TokenizerReply:
    call = TokenizerCall(id=secrets.token_urlsafe(12), deadline=time.time() + CALL_TIMEOUT_S, **fields)
    snapshot = await state.fleet.snapshot()
    stores = state.placement.order(state.shards.stores_of(model), model, snapshot, None, placing=False)
    redis, keys = stores[0].redis, stores[0].keys  # its workers answer on their store: one with room
    calls = keys.tokenizer_calls(model)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.lpush(calls, call.model_dump_json(exclude_none=True))
        pipe.expire(calls, int(CALL_TIMEOUT_S) + 1)  # calls nobody took go away with their callers
        await pipe.execute()
    popped = await redis.blpop([keys.tokenizer_reply(call.id)], timeout=CALL_TIMEOUT_S)  # type: ignore[misc]
    if popped is None:
        raise ApiError(
            504,
            f"no worker of model {model!r} answered within {CALL_TIMEOUT_S:g} s",
            code=ErrorCode.worker_timeout,
            headers={"Retry-After": "1"},
        )
    reply = TokenizerReply.model_validate_json(popped[1])
    if reply.error is not None:
        param = reply.param or ("tokens" if call.op == "detokenize" else "prompt")
        raise ApiError(400, reply.error, param=param)
    return reply


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
