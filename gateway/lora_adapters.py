"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, for a fleet: an operator loads a
LoRA adapter into every live worker of a model, or unloads it, without a restart.

A load is recorded in each of the model's stores first (a worker that starts later loads it too), then sent
to every live worker of the model on its own list (common/adapter_calls.py); it answers 200 once every one
has loaded it and updated its registry entry. Where one refuses it (it does not fit the model, cannot be
read on that host, the worker's engine serves no adapters) or does not answer in time, the record goes and
every worker unloads it: no worker keeps an adapter the others lack. An unload takes it out of the record,
then every worker refuses new requests naming it (their running rows finish).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from common.adapter_calls import REPLY_TTL_S, AdapterCall, AdapterReply
from common.error_codes import ErrorCode
from common.registry import live_workers
from gateway.errors import ApiError
from gateway.operations import STRING, Operation, Reply
from gateway.request_body import parse_body
from gateway.shards import Shard
from gateway.state import AppState, app_state
from gateway.submission import no_live_worker, resolve_model

BLOCK_S = 1.0  # each wait for a reply: well under the connections' socket timeout


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the base model's served name; optional when one is served")
    lora_name: str = Field(..., min_length=1, max_length=256)

    @field_validator("lora_name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if name != name.strip() or any(not c.isprintable() for c in name):
            raise ValueError("an adapter's name is printable text without surrounding spaces")
        return name


class LoadLoraAdapterRequest(UnloadLoraAdapterRequest):
    lora_path: str = Field(
        ..., min_length=1, max_length=4096, description="the PEFT folder, read on each worker's host"
    )


UnloadRequestT = TypeVar("UnloadRequestT", bound=UnloadLoraAdapterRequest)


def _operators(summary: str, request: type[BaseModel]) -> Operation:
    return Operation(
        f"vLLM's: {summary} (operators: the admin key; ORTFLEET_ALLOW_RUNTIME_LORA_UPDATING)",
        request=request,
        responses={200: Reply("done on every live worker of the model", STRING, media_type="text/plain")},
        errors=(400, 403, 404, 503, 504),
    )


@_operators("loads a LoRA adapter into every live worker of a model", LoadLoraAdapterRequest)
async def load_lora_adapter(request: Request) -> Response:
    state, body, model = await _operator_call(request, LoadLoraAdapterRequest)
    name, path = body.lora_name, body.lora_path
    fleet = await state.fleet.snapshot(fresh=True)
    if name in fleet.known or name in fleet.adapters:
        raise _exists(name, "a served model's name" if name in fleet.known else None)
    stores = state.shards.stores_of(model)
    if not await _record(stores, model, name, path):
        raise _exists(name, None)
    timeout = state.settings.lora_update_timeout_s
    call = AdapterCall(id=_call_id(), op="load", name=name, path=path, deadline=time.time() + timeout)
    replies, silent = await _broadcast(stores, model, call)
    refused = [reply for reply in replies if not reply.ok]
    if refused or silent or not replies:  # (none: its workers left since the registry was read)
        await _forget(stores, model, name)
        undo = AdapterCall(id=_call_id(), op="unload", name=name, deadline=time.time() + timeout)
        await _broadcast(stores, model, undo)  # a worker that came meanwhile may have it from the record
        if not replies and not silent:
            raise no_live_worker(model, " to load the adapter into")
        if refused:
            raise ApiError(
                400,
                f"the LoRA adapter {name!r} was not loaded: worker {refused[0].worker} refused it: "
                f"{refused[0].error}; no worker of model {model!r} keeps it",
                param="lora_path",
                code=ErrorCode.adapter_refused,
            )
        raise ApiError(
            504,
            f"the LoRA adapter {name!r} was not loaded: worker(s) {', '.join(silent)} did not answer within "
            f"{timeout:g} s (ORTFLEET_LORA_UPDATE_TIMEOUT_S); it was unloaded from every worker of model "
            f"{model!r}",
            code=ErrorCode.worker_timeout,
        )
    await state.fleet.snapshot(fresh=True)  # this gateway serves it from now on
    return PlainTextResponse(
        f"Success: LoRA adapter {name!r} added successfully to model {model!r} on {len(replies)} worker(s)."
    )


@_operators("unloads a LoRA adapter loaded at run time from its model's workers", UnloadLoraAdapterRequest)
async def unload_lora_adapter(request: Request) -> Response:
    state, body, model = await _operator_call(request, UnloadLoraAdapterRequest)
    name = body.lora_name
    stores = state.shards.stores_of(model)
    if not await _forget(stores, model, name):
        fleet = await state.fleet.snapshot(fresh=True)
        live = fleet.live.get(model)
        if live is not None and name in live.adapters:
            raise ApiError(
                400,
                f"the LoRA adapter {name!r} was given to the workers of model {model!r} at start (--lora, "
                "ORTFLEET_LORA_MODULES): restart them without it to stop serving it",
                param="lora_name",
                code=ErrorCode.adapter_refused,
            )
        raise ApiError(
            404,
            f"The lora adapter {name!r} cannot be found: model {model!r} has no adapter of that name loaded "
            "at run time",
            param="lora_name",
            code=ErrorCode.adapter_not_found,
        )
    timeout = state.settings.lora_update_timeout_s
    call = AdapterCall(id=_call_id(), op="unload", name=name, deadline=time.time() + timeout)
    replies, silent = await _broadcast(stores, model, call)
    if silent:
        raise ApiError(
            504,
            f"the LoRA adapter {name!r} is out of model {model!r}'s record, but worker(s) "
            f"{', '.join(silent)} did not answer in {timeout:g} s: each unloads it as it takes the call",
            code=ErrorCode.worker_timeout,
        )
    await state.fleet.snapshot(fresh=True)
    return PlainTextResponse(
        f"Success: LoRA adapter {name!r} removed successfully from model {model!r} on {len(replies)} "
        "worker(s)."
    )


def _check_enabled(state: AppState) -> None:
    if not state.settings.allow_runtime_lora_updating:
        raise ApiError(
            404,
            "loading and unloading LoRA adapters at run time is off on this gateway: an operator turns it on "
            "with ORTFLEET_ALLOW_RUNTIME_LORA_UPDATING=true",
            code=ErrorCode.runtime_lora_updating_disabled,
        )


async def _operator_call(
    request: Request, body_type: type[UnloadRequestT]
) -> tuple[AppState, UnloadRequestT, str]:
    """The gateway's state, the call's body and the base model it names, once runtime updates are on."""
    state = app_state(request)
    _check_enabled(state)
    body = await parse_body(request, body_type, invalid_status=400)
    return state, body, await _base_model(state, body.model)


async def _base_model(state: AppState, requested: str | None) -> str:
    """The served model a load or unload names (the only one, when it names none): 400 when it must name
    one or names an adapter, 404 unknown, 503 without a live worker."""
    try:
        served = await resolve_model(state, requested)
    except ApiError as e:  # vLLM's routes answer bad values with 400
        if e.status != 422:
            raise
        raise ApiError(400, e.message, param=e.param, code=e.code) from e
    if served.adapter is not None:
        raise ApiError(
            400,
            f"model: {served.adapter!r} is a LoRA adapter of model {served.model!r}; name the base model",
            param="model",
        )
    if served.model not in (await state.fleet.snapshot(fresh=True)).live:
        raise no_live_worker(served.model, " to load or unload its adapters")
    return served.model


def _exists(name: str, what: str | None) -> ApiError:
    also = f" ({what})" if what else ""
    return ApiError(
        400,
        f"The lora adapter {name!r} has already been loaded{also}",
        param="lora_name",
        code=ErrorCode.adapter_exists,
    )


def _call_id() -> str:
    return secrets.token_urlsafe(12)


async def _record(stores: list[Shard], model: str, name: str, path: str) -> bool:
    """Records the adapter in every store of the model; False (and nothing recorded) when one has it."""
    recorded = [await store.redis.hsetnx(store.keys.runtime_adapters(model), name, path) for store in stores]  # type: ignore[misc]
    if all(recorded):
        return True
    for store, mine in zip(stores, recorded, strict=True):
        if mine:
            await store.redis.hdel(store.keys.runtime_adapters(model), name)  # type: ignore[misc]
    return False


async def _forget(stores: list[Shard], model: str, name: str) -> bool:
    """Takes the adapter out of every store's record; whether one had it."""
    removed = [await store.redis.hdel(store.keys.runtime_adapters(model), name) for store in stores]  # type: ignore[misc]
    return any(removed)


Answers = tuple[list[AdapterReply], list[str]]  # the replies, and the workers that gave none


async def _broadcast(stores: list[Shard], model: str, call: AdapterCall) -> Answers:
    """Sends the call to every live worker of the model and waits for their replies until its deadline:
    the replies, and the workers that gave none."""
    done = await asyncio.gather(*(_call_store(store, model, call) for store in stores))
    return [reply for replies, _ in done for reply in replies], [w for _, silent in done for w in silent]


async def _call_store(store: Shard, model: str, call: AdapterCall) -> Answers:
    registered = await live_workers(store.redis, store.keys)
    workers = [entry["id"] for entry in registered if entry.get("model") == model]
    if not workers:
        return [], []
    keep_s = int(call.deadline - time.time()) + REPLY_TTL_S
    async with store.redis.pipeline(transaction=False) as pipe:
        for worker in workers:
            pipe.lpush(store.keys.adapter_calls(worker), call.model_dump_json(exclude_none=True))
            pipe.expire(store.keys.adapter_calls(worker), keep_s)  # a dead worker's calls go away
        await pipe.execute()
    replies: dict[str, AdapterReply] = {}
    key = store.keys.adapter_reply(call.id)
    while len(replies) < len(workers) and (left := call.deadline - time.time()) > 0:
        wait = min(left, BLOCK_S)
        popped = await store.redis.blpop([key], timeout=wait)  # type: ignore[misc, arg-type]
        if popped is not None:
            reply = AdapterReply.model_validate_json(popped[1])
            replies[reply.worker] = reply
    return list(replies.values()), [worker for worker in workers if worker not in replies]


routes = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
