"""Answers the gateway's tokenize and detokenize calls for this worker's model."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.keys import Keyspace
from common.tokenizer_calls import REPLY_TTL_S, TokenizerCall, TokenizerReply
from worker.engine import Tokenizer

logger = logging.getLogger(__name__)

POLL_S = 1


def answer(call: TokenizerCall, tokenizer: Tokenizer) -> TokenizerReply:
    try:
        if call.op == "detokenize":
            tokens = call.tokens or []
            refused = _outside_vocabulary(tokens, tokenizer.vocab_size)
            return refused or TokenizerReply(text=tokenizer.decode(tokens))
        if call.messages is not None:
            text = tokenizer.apply_chat_template(json.dumps([m.model_dump() for m in call.messages]))
        else:
            text = call.prompt or ""
        return TokenizerReply(tokens=tokenizer.encode(text))
    except Exception as e:  # a bad token id, a template error: the caller's problem, not the worker's
        return TokenizerReply(error=f"the tokenizer refused it: {e}")


def _outside_vocabulary(tokens: list[int], vocab_size: int | None) -> TokenizerReply | None:
    """The refusal of the first id that is no token of the model (the tokenizer would decode it as
    U+FFFD or nothing), if any."""
    for i, token in enumerate(tokens):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            ids = (
                f"its {vocab_size} ids are 0 to {vocab_size - 1}"
                if vocab_size is not None
                else "ids are 0 and up"
            )
            return TokenizerReply(
                error=f"tokens.{i}: {token} is not a token id of this model ({ids})",
                param=f"tokens.{i}",
            )
    return None


async def serve_tokenizer(redis: Redis, keys: Keyspace, model: str, tokenizer: Tokenizer) -> None:
    """Pops calls from the model's list until cancelled; a Redis outage only pauses it."""
    calls = keys.tokenizer_calls(model)
    while True:
        try:
            popped = await redis.brpop([calls], timeout=POLL_S)  # type: ignore[misc]
            if popped is None:
                continue
            try:
                call = TokenizerCall.model_validate_json(popped[1])
            except ValidationError as e:
                logger.warning("a malformed tokenizer call was dropped: %s", e)
                continue
            if call.deadline < time.time():
                continue
            reply = keys.tokenizer_reply(call.id)
            async with redis.pipeline(transaction=True) as pipe:
                pipe.rpush(reply, answer(call, tokenizer).model_dump_json(exclude_none=True))
                pipe.expire(reply, REPLY_TTL_S)
                await pipe.execute()
        except RedisError as e:
            logger.warning("tokenizer calls paused: %s", e)
            await asyncio.sleep(POLL_S)
