"""LoRA adapters loaded and unloaded at run time (vLLM's /v1/load_lora_adapter): the calls a gateway sends
to every live worker of a model, each on the worker's own list, and the replies they push to the call's.

A model's runtime adapters are recorded in its stores (keys.runtime_adapters: name -> folder on the
workers' hosts), so a worker that starts later loads them too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis

from common.keys import Keyspace

REPLY_TTL_S = 60


class AdapterCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    op: Literal["load", "unload"]
    name: str
    path: str = ""  # a load's: the PEFT folder, read on the worker's host
    deadline: float  # wall clock; a worker skips a load whose caller has given up (never an unload)


class AdapterReply(BaseModel):
    worker: str
    ok: bool
    error: str | None = None  # why it refused: the adapter does not fit, cannot be read, ...


async def runtime_adapters(redis: Redis, keys: Keyspace, model: str) -> dict[str, str]:
    """The model's adapters loaded at run time, name: folder (as recorded in this store)."""
    recorded: dict[str, str] = await redis.hgetall(keys.runtime_adapters(model))  # type: ignore[misc]
    return recorded
