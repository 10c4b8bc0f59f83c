"""A worker's entry in the fleet registry, kept alive by its heartbeat."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from redis.asyncio import Redis

from common.keys import Keyspace


@dataclass
class WorkerInfo:
    id: str
    model: str
    device: str
    gpu: str
    capacity: int
    context_length: int
    continuous_batching: bool
    host: str
    pid: int
    started_at: float
    in_flight: int = 0
    state: str = "ready"  # ready | draining | recovering (its engine failed: it serves nothing until rebuilt)
    generated_tokens: int = 0  # since the worker started, running jobs included
    tokens_per_s: float = 0.0  # over the last few seconds
    speed_tokens_per_s: float = 0.0  # prompt and generated tokens a second over its last 10 s of running jobs
    metrics_url: str = ""  # its Prometheus /metrics
    # KV tokens (prompt and max_tokens) one job may need here: ORTFLEET_KV_BUDGET_TOKENS where it is
    # below the context, else 0 (any job that fits the context fits); claim.lua passes over larger jobs.
    kv_budget_tokens: int = 0
    model_dir: str = ""  # the folder it serves (on its host)
    fingerprint: str = ""  # its model's (common/model_folder.py's model_fingerprint): one per served name
    # Where its engine runs (ORTFLEET_ENGINE_CORE): in-process, own (an engine core of its own) or shared
    # (a core that serves other workers too).
    engine_core: str = "in-process"
    # The LoRA adapters it serves (ORTFLEET_LORA_MODULES): name -> folder (on its host). Every worker of a
    # model serves the same names; a request naming one is a job of the model with that adapter.
    adapters: dict[str, str] = field(default_factory=dict)
    # Those of `adapters` loaded at run time (common/adapter_calls.py), not given at start: every worker of a
    # model is given the same adapters at start, whatever was loaded since.
    runtime_adapters: list[str] = field(default_factory=list)


async def heartbeat(redis: Redis, keys: Keyspace, info: WorkerInfo, ttl_s: float, remember_s: int) -> None:
    """Refresh the worker's entry; the model stays known for `remember_s` after its last worker."""
    now = time.time()
    fields = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in asdict(info).items()}
    fields["heartbeat_at"] = str(now)
    model_info = {
        "context_length": info.context_length,
        "continuous_batching": info.continuous_batching,
        "adapters": sorted(info.adapters),
    }
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.worker(info.id), mapping=fields)
        pipe.pexpire(keys.worker(info.id), int(ttl_s * 1000))
        pipe.zadd(keys.workers, {info.id: int((now + ttl_s) * 1000)})
        pipe.pexpire(keys.workers, int(ttl_s * 1000))
        pipe.hset(keys.models, info.model, json.dumps(model_info))
        pipe.expire(keys.models, remember_s)
        await pipe.execute()


def serving(entry: dict[str, str]) -> bool:
    """Whether a registry entry's worker can run jobs now (a recovering one cannot, for a while)."""
    return entry.get("state", "ready") != "recovering"


def worker_adapters(entry: dict[str, str]) -> dict[str, str]:
    """A registry entry's LoRA adapters, name: folder (none from a worker that serves none)."""
    adapters: dict[str, str] = json.loads(entry.get("adapters") or "{}")
    return adapters


def start_adapters(entry: dict[str, str]) -> list[str]:
    """The names of a registry entry's adapters given at start (ORTFLEET_LORA_MODULES), sorted."""
    runtime = set(json.loads(entry.get("runtime_adapters") or "[]"))
    return sorted(name for name in worker_adapters(entry) if name not in runtime)


async def deregister(redis: Redis, keys: Keyspace, worker_id: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.worker(worker_id))
        pipe.zrem(keys.workers, worker_id)
        await pipe.execute()


async def live_workers(redis: Redis, keys: Keyspace) -> list[dict[str, str]]:
    """Workers whose heartbeat has not expired (stale ids are pruned on the way)."""
    now_ms = int(time.time() * 1000)
    await redis.zremrangebyscore(keys.workers, "-inf", now_ms)
    ids: list[str] = await redis.zrange(keys.workers, 0, -1)
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(keys.worker(worker_id))
        entries: list[dict[str, str]] = await pipe.execute()
    return [entry for entry in entries if entry]
