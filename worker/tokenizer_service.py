"""Answers the gateway's tokenize and detokenize calls for this worker's model."""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from common.keys import Keyspace
from common.tokenizer_calls import REPLY_TTL_S, TokenizerCall, TokenizerReply
from worker.calls import Reply, answer_calls
from worker.engine import Tokenizer


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
    """Answers calls from the model's list until cancelled; a Redis outage only pauses it."""

    async def reply(call: TokenizerCall) -> Reply:
        if call.deadline < time.time():
            return None  # its caller gave up
        return keys.tokenizer_reply(call.id), answer(call, tokenizer)

    await answer_calls(redis, keys.tokenizer_calls(model), TokenizerCall, "tokenizer", reply, REPLY_TTL_S)
