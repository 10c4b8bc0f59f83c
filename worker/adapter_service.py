"""Loads and unloads LoRA adapters at run time as the gateway's calls say (common/adapter_calls.py), and
keeps the worker's registry entry saying which it serves.

Once the worker is live in the registry it first matches its adapters to its model's record (a load or an
unload may have come while it started and before a gateway could see it), then answers the calls on its
own list, one at a time, in their order: a load's rollback (an unload) always comes after the load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from redis.exceptions import RedisError

from common.adapter_calls import REPLY_TTL_S, AdapterCall, AdapterReply, runtime_adapters
from worker.calls import POLL_S, Reply, answer_calls
from worker.service import WorkerService

logger = logging.getLogger(__name__)


@runtime_checkable
class RuntimeAdapters(Protocol):
    """An engine that loads and unloads adapters while it runs (ortfleet's batcher)."""

    async def load_adapter(self, name: str, folder: Path) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...


class AdapterService:
    """`refusal`: why this worker cannot load adapters at run time (its engine), None where it can."""

    def __init__(self, service: WorkerService, refusal: str | None) -> None:
        self.service = service
        self.info = service.info
        engine = service.engine
        self.engine = engine if refusal is None and isinstance(engine, RuntimeAdapters) else None
        self.refusal = refusal or "this worker's engine does not load adapters at run time"

    async def run(self) -> None:
        """Matches the record once the worker is registered, then answers calls until cancelled; a Redis
        outage only pauses it."""
        service = self.service
        await service.heartbeat.registered.wait()
        while True:  # a Redis outage only pauses it
            try:
                await self.match_record()
                break
            except RedisError as e:
                logger.warning("adapter calls paused: %s", e)
                await asyncio.sleep(POLL_S)

        async def reply(call: AdapterCall) -> Reply:
            if call.op == "load" and call.deadline < time.time():
                return None  # its caller gave up, and rolls it back
            return service.keys.adapter_reply(call.id), await self.answer(call)

        calls = service.keys.adapter_calls(self.info.id)
        await answer_calls(service.redis, calls, AdapterCall, "adapter", reply, REPLY_TTL_S)

    async def answer(self, call: AdapterCall) -> AdapterReply:
        try:
            error = await (self.load(call.name, call.path) if call.op == "load" else self.unload(call.name))
        except RedisError:
            raise
        except Exception as e:  # the worker's own failure: the caller hears of it, the service goes on
            logger.exception("the adapter call %s %r failed", call.op, call.name)
            error = f"worker {self.info.id} failed to {call.op} the adapter {call.name!r}: {type(e).__name__}"
        return AdapterReply(worker=self.info.id, ok=error is None, error=error)

    async def load(self, name: str, path: str) -> str | None:
        """None once the adapter is served (or was already, from the same folder), else why not."""
        from worker.engines.batcher.engine import AdapterTaken
        from worker.engines.batcher.lora import AdapterMismatch, AdapterUnreadable
        from worker.engines.batcher.lora_graph import LoraGraphError

        if self.info.adapters.get(name) == path and name in self.info.runtime_adapters:
            return None
        if name in self.info.adapters:
            return f"the adapter {name!r} is already loaded on worker {self.info.id}"
        if self.engine is None:
            return self.refusal
        try:
            await self.engine.load_adapter(name, Path(path))
        except (AdapterMismatch, AdapterUnreadable, AdapterTaken, LoraGraphError) as e:
            return str(e)
        except (RuntimeError, ValueError, OSError) as e:  # a session the rewritten graph cannot open
            logger.exception("loading the adapter %r failed", name)
            return f"the adapter {name!r} could not be loaded: {type(e).__name__}"
        self.info.adapters[name] = path
        self.info.runtime_adapters.append(name)
        if self.service.on_adapter_loaded is not None:
            self.service.on_adapter_loaded(name)
        await self.service.heartbeat.beat_now()
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return None

    async def unload(self, name: str) -> str | None:
        """None once new requests naming the adapter are refused (or it was not loaded here)."""
        if name not in self.info.runtime_adapters:
            if name in self.info.adapters:
                return f"the adapter {name!r} was given at start (--lora) on worker {self.info.id}"
            return None
        if self.engine is not None:
            try:
                await self.engine.unload_adapter(name)
            except KeyError:  # the engine does not serve it (an unload already under way): nothing to do
                pass
        del self.info.adapters[name]
        self.info.runtime_adapters.remove(name)
        await self.service.heartbeat.beat_now()
        logger.info("LoRA adapter %r unloaded: its running requests finish", name)
        return None

    async def match_record(self) -> None:
        """Loads the model's recorded adapters this worker lacks and unloads those no longer recorded."""
        service = self.service
        recorded = await runtime_adapters(service.redis, service.keys, self.info.model)
        for name in [name for name in self.info.runtime_adapters if name not in recorded]:
            await self.unload(name)
        for name, path in recorded.items():
            if name not in self.info.adapters:
                error = await self.load(name, path)
                if error is not None:
                    logger.warning("the recorded LoRA adapter %r is not served here: %s", name, error)
