"""Which worker holds a conversation's prompt KV, so that its next turn can go there.

A worker that keeps prompts for reuse (the batcher's prefix cache) leaves a hint for each leading run of
a finished chat's messages (its first message, its first two, ...): the run's digest, chained from the
job's cache scope (gateway/cache_scope.py), names the worker, for HINT_TTL_S. A gateway submitting a chat
looks up the digests of its own leading runs in its own scope, longest first, so a chat is never routed
by the prompt of another scope's job; a live worker with a free slot that holds one becomes the job's
preferred worker, and the claim lets it take the job first for a short while
(ORTFLEET_PREFIX_ROUTE_WAIT_S). A hint is only a hint: the
worker may have overwritten that prompt since, and then the job prefills it again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from redis.asyncio import Redis

from common.keys import Keyspace
from common.registry import live_workers
from common.wire import ChatMessage

HINT_TTL_S = 600
BALANCE_SLACK = 2  # jobs the holder may run beyond the least busy worker and still be preferred


def hint_keys(model: str, scope: str, messages: Sequence[ChatMessage], keys: Keyspace) -> list[str]:
    """One key for each leading run of the messages in the cache scope, shortest first."""
    digest = hashlib.sha256(json.dumps(["scope", scope]).encode())
    found = []
    for message in messages:
        digest.update(json.dumps([message.role, message.content]).encode())
        found.append(keys.prefix_hint(model, digest.copy().hexdigest()[:32]))
    return found


async def leave_hints(
    redis: Redis, keys: Keyspace, model: str, scope: str, messages: Sequence[ChatMessage], worker_id: str
) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for key in hint_keys(model, scope, messages, keys):
            pipe.set(key, worker_id, ex=HINT_TTL_S)
        await pipe.execute()


async def preferred_worker(
    redis: Redis, keys: Keyspace, model: str, scope: str, messages: Sequence[ChatMessage]
) -> str | None:
    """The worker that holds the longest leading run of the messages in the scope, if it is live, ready,
    has a free slot, and runs no more than BALANCE_SLACK jobs beyond the least busy ready worker of the
    model (as cache-aware routers balance: a prefix is worth a short wait, not a queue behind one
    worker)."""
    holders: list[str | None] = await redis.mget(hint_keys(model, scope, messages, keys))
    worker_id = next((holder for holder in reversed(holders) if holder), None)
    if worker_id is None:
        return None
    ready = {
        entry["id"]: entry
        for entry in await live_workers(redis, keys)
        if entry.get("model") == model and entry.get("state") == "ready"
    }
    holder = ready.get(worker_id)
    if holder is None:
        return None
    load = int(holder.get("in_flight", "0"))
    least = min(int(entry.get("in_flight", "0")) for entry in ready.values())
    has_room = load < int(holder.get("capacity", "0"))
    return worker_id if has_room and load <= least + BALANCE_SLACK else None
