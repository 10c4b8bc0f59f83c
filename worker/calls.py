"""The loop of a worker's services that answer a gateway's calls on a Redis list (tokenizer calls, adapter
calls): each call popped, parsed, answered and its reply pushed to the call's own list for a while."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

POLL_S = 1  # each wait for a call, and the pause after a Redis error

CallT = TypeVar("CallT", bound=BaseModel)
# A call's reply: the list it goes to and what it says, or None for no reply (its caller gave up).
Reply = tuple[str, BaseModel] | None


async def answer_calls(
    redis: Redis,
    calls: str,
    call_type: type[CallT],
    what: str,
    answer: Callable[[CallT], Awaitable[Reply]],
    reply_ttl_s: int,
) -> None:
    """Pops calls from the list `calls` until cancelled, in order, and pushes each reply (kept `reply_ttl_s`);
    a malformed call is dropped with a warning naming `what` calls, and a Redis outage only pauses it."""
    while True:
        try:
            popped = await redis.brpop([calls], timeout=POLL_S)  # type: ignore[misc]
            if popped is None:
                continue
            try:
                call = call_type.model_validate_json(popped[1])
            except ValidationError as e:
                logger.warning("a malformed %s call was dropped: %s", what, e)
                continue
            reply = await answer(call)
            if reply is None:
                continue
            key, body = reply
            async with redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, body.model_dump_json(exclude_none=True))
                pipe.expire(key, reply_ttl_s)
                await pipe.execute()
        except RedisError as e:
            logger.warning("%s calls paused: %s", what, e)
            await asyncio.sleep(POLL_S)
