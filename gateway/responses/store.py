"""Responses kept in Redis, where any gateway finds them: a response's record (a hash: what its request
asked for, its input items), its job (on the model's shard), and what a later response that continues
it (`previous_response_id`) is given."""

from __future__ import annotations

import json
from typing import Any

import anyio

from common.error_codes import ErrorCode
from common.events import entry_logprobs
from common.wire import TERMINAL
from gateway.errors import ApiError
from gateway.owned import OwnedKind
from gateway.responses.output import view_from_job
from gateway.state import AppState
from gateway.streaming.reading import SentTokens

RESPONSE = OwnedKind("response", "response_id", ErrorCode.response_not_found, "resp_")


async def load_meta(state: AppState, resp_id: str, owner: str) -> dict[str, str]:
    meta: dict[str, str] = await state.redis.hgetall(state.keys.response(resp_id))  # type: ignore[misc]
    if not meta or meta.get("owner", "") != owner or meta.get("store") != "1":
        raise RESPONSE.not_found(resp_id)
    return meta


async def save_meta(state: AppState, meta: dict[str, str]) -> None:
    """Keeps a stored response's record as long as its job; of an unstored one, only its owner (so a
    continuation of it is told why it cannot be)."""
    ttl = state.settings.job_ttl_s
    if meta["store"] == "1":
        await state.redis.hset(state.keys.response(meta["id"]), mapping=meta)  # type: ignore[misc]
        await state.redis.expire(state.keys.response(meta["id"]), ttl)
    else:
        await state.redis.set(state.keys.unstored_response(meta["id"]), meta["owner"], ex=ttl)


async def job_logprobs(state: AppState, meta: dict[str, str]) -> list[dict[str, Any]] | None:
    """The logprobs of the job's tokens, read from its stream, when the request asked for them."""
    if meta.get("logprobs") != "1":
        return None
    shard = state.shards.of_job(meta["job_id"], meta["model"])
    sent, found = SentTokens(), []
    for _id, fields in await shard.redis.xrange(shard.keys.events(meta["job_id"])):
        if sent.fresh(fields) and (entries := entry_logprobs(fields)):
            found.extend(entries)
    return found


async def current_view(state: AppState, meta: dict[str, str]) -> dict[str, Any]:
    record = await state.shards.of_job(meta["job_id"], meta["model"]).queue.record(meta["job_id"])
    return view_from_job(meta, record, await job_logprobs(state, meta))


async def forget_unstored(state: AppState, meta: dict[str, str]) -> None:
    """Deletes the job of a response created with `store: false` once it has been answered (or its
    client left): as on OpenAI, such a response cannot be retrieved later, as a response or a job."""
    if meta["store"] != "1":
        with anyio.CancelScope(shield=True):
            await state.shards.of_job(meta["job_id"], meta["model"]).queue.purge(
                meta["job_id"], meta["model"]
            )


async def delete(state: AppState, meta: dict[str, str]) -> None:
    """Removes the response and its job (a running one stops)."""
    with anyio.CancelScope(shield=True):
        await state.redis.delete(state.keys.response(meta["id"]))
        await state.shards.of_job(meta["job_id"], meta["model"]).queue.purge(meta["job_id"], meta["model"])


async def earlier_items(state: AppState, previous_id: str, owner: str) -> list[dict[str, Any]]:
    """What a response that continues `previous_id` is given before its own input: that response's input
    items (its whole conversation) and its output items. 404 naming `previous_response_id` for a
    response this key does not have, 400 for one made with `store: false` or not ended yet."""
    param = "previous_response_id"
    meta: dict[str, str] = await state.redis.hgetall(state.keys.response(previous_id))  # type: ignore[misc]
    if not meta or meta.get("owner") != owner:
        if await state.redis.get(state.keys.unstored_response(previous_id)) == owner:
            message = (
                f"{param}: response {previous_id!r} was created with store=false and cannot be continued"
            )
            raise ApiError(400, message, param=param)
        raise ApiError(
            404,
            f"{param}: response {previous_id!r} does not exist (or has expired)",
            param=param,
            code=ErrorCode.response_not_found,
        )
    record = await state.shards.of_job(meta["job_id"], meta["model"]).queue.record(meta["job_id"])
    if record is None:
        raise ApiError(
            404,
            f"{param}: response {previous_id!r} has expired",
            param=param,
            code=ErrorCode.response_not_found,
        )
    if record.status not in TERMINAL:
        message = (
            f"{param}: response {previous_id!r} is still {record.status.value}; continue it once it has ended"
        )
        raise ApiError(400, message, param=param)
    output = view_from_job(meta, record)["output"]
    done = [item for item in output if item["type"] != "function_call" or item["status"] == "completed"]
    items: list[dict[str, Any]] = json.loads(meta.get("input") or "[]")
    return [*items, *done]


def stored_items(meta: dict[str, str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(meta.get("input") or "[]")
    return items
