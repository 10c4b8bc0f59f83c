"""`GET /v1/fleet`: the fleet as the console draws it (models, workers, queues, Redis problems).

A gateway without keys shows everything. On a gateway with keys, an ordinary key gets the fleet's
shape (models, workers, devices, engine modes, slots, heartbeats) but not its load (jobs in flight,
tokens per second, queue depth, jobs of the last minute), as `GET /v1/models` hides `in_flight` from
it; the metrics key (`ORTFLEET_METRICS_API_KEY`) gets the load too. No answer names a key.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.fleet_stats import known_models, queue_stats, recent_outcomes, summed
from common.registry import live_workers, serving, worker_adapters
from gateway.auth import principal_of
from gateway.operations import OBJECT, Operation, Reply
from gateway.state import AppState, app_state

LOAD_FIELDS = ("in_flight", "tokens_per_s", "generated_tokens")
MODEL_LOAD_FIELDS = (
    "in_flight", "tokens_per_s", "queued", "queued_by_class", "oldest_wait_s", "finished_last_minute",
    "failed_last_minute",
)  # fmt: skip


def engine_mode(entry: dict[str, str]) -> str:
    """How the worker's engine admits requests: `continuous` batching or `static` batches."""
    return "continuous" if entry.get("continuous_batching", "false") == "true" else "static"


def worker_entry(entry: dict[str, str], now: float) -> dict[str, Any]:
    return {
        "id": entry.get("id", "?"),
        "model": entry.get("model", "?"),
        "device": entry.get("device", "?"),
        "gpu": entry.get("gpu", ""),
        "engine_mode": engine_mode(entry),
        "engine_core": entry.get("engine_core", "in-process"),
        "state": entry.get("state", "ready"),
        "ready": serving(entry),
        "capacity": int(entry.get("capacity", "0")),
        "in_flight": int(entry.get("in_flight", "0")),
        "tokens_per_s": round(float(entry.get("tokens_per_s", "0")), 2),
        "generated_tokens": int(entry.get("generated_tokens", "0")),
        "heartbeat_age_s": round(max(0.0, now - float(entry.get("heartbeat_at", now))), 3),
        "started_at": float(entry.get("started_at", "0")),
        "adapters": sorted(worker_adapters(entry)),
    }


async def _models_of(
    state: AppState, names: list[str], workers: list[dict[str, Any]], now: float
) -> list[dict[str, Any]]:
    queues, outcomes = [], []
    for shard, mine in state.shards.holding(names):  # a model's figures from each of its stores, summed
        queues.append(await queue_stats(shard.redis, shard.keys, mine, now))
        outcomes.append(await recent_outcomes(shard.redis, shard.keys, mine, now))
    queue, outcome = summed(queues), summed(outcomes)
    models = []
    for name in names:
        serving_it = [w for w in workers if w["model"] == name]
        models.append(
            {
                "id": name,
                "workers": len(serving_it),
                "ready_workers": sum(1 for w in serving_it if w["ready"]),
                "capacity": sum(w["capacity"] for w in serving_it),
                "in_flight": sum(w["in_flight"] for w in serving_it),
                "tokens_per_s": round(sum(w["tokens_per_s"] for w in serving_it), 2),
                "queued": queue[name].depth,
                "queued_by_class": queue[name].by_class,
                "oldest_wait_s": round(queue[name].oldest_wait_s, 3),
                "finished_last_minute": outcome[name].finished,
                "failed_last_minute": outcome[name].failed,
                "adapters": sorted({a for w in serving_it for a in w["adapters"]}),
            }
        )
    return models


@Operation(
    "Models, live workers, queues and Redis problems; load figures only without keys or with the metrics key",
    responses={200: Reply("the fleet", OBJECT)},
)
async def fleet_overview(request: Request) -> Response:
    state = app_state(request)
    now = time.time()
    workers: list[dict[str, Any]] = []
    names: set[str] = set()
    for store, shard in state.shards.named():
        workers += [
            {**worker_entry(entry, now), "store": store}
            for entry in await live_workers(shard.redis, shard.keys)
        ]
        names |= set(await known_models(shard.redis, shard.keys))
    names |= {w["model"] for w in workers}
    workers.sort(key=lambda w: (w["model"], w["id"]))
    models = await _models_of(state, sorted(names), workers, now)
    problems = [line for name, shard in state.shards.named() for line in shard.watch.problems(name)]
    load = principal_of(request.scope).name == ""  # no keys, or the metrics key (see gateway.auth)
    if not load:
        for worker in workers:
            for field in LOAD_FIELDS:
                del worker[field]
        for model in models:
            for field in MODEL_LOAD_FIELDS:
                del model[field]
    stores = [{"name": name, "node": shard.watch.node} for name, shard in state.shards.named()]
    overview = {"object": "fleet", "taken_at": now, "load": load, "models": models, "workers": workers}
    return JSONResponse({**overview, "stores": stores, "store": problems})


routes = [Route("/v1/fleet", fleet_overview, methods=["GET"])]
