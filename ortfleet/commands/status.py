"""`ortfleet status` and `ortfleet top`: the fleet at a glance in a terminal, read from Redis alone."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.fleet_stats import known_models, queue_stats, recent_outcomes, summed
from common.keys import Keyspace
from common.redis_client import cluster_node, connect_store
from common.redis_url import mask_url
from common.registry import live_workers, worker_adapters
from common.settings import FleetSettings
from common.store_watch import store_node
from common.stores import Store
from gateway.batch_progress import BatchProgress, active_batches

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers

CLEAR_SCREEN = "\x1b[H\x1b[2J"
WORKER_COLUMNS = ("WORKER", "MODEL", "DEVICE", "STATE", "SLOTS", "IN FLIGHT", "TOK/S", "HEARTBEAT", "METRICS")
MODEL_COLUMNS = (
    "MODEL", "WORKERS", "SLOTS", "IN FLIGHT", "QUEUED", "OLDEST WAIT", "TOK/S", "DONE 1m", "FAILED 1m",
)  # fmt: skip
BATCH_COLUMNS = ("BATCH", "OWNER", "STATUS", "ANSWERED", "TOTAL", "FAILED", "IN FLIGHT", "AGE")


@dataclass(frozen=True)
class WorkerRow:
    id: str
    model: str
    device: str
    state: str
    capacity: int
    in_flight: int
    tokens_per_s: float
    generated_tokens: int
    heartbeat_age_s: float
    metrics_url: str
    adapters: list[str] = field(default_factory=list)  # the LoRA adapters it serves, by name


@dataclass(frozen=True)
class ModelRow:
    name: str
    workers: int
    capacity: int
    in_flight: int
    queued: int
    oldest_wait_s: float
    tokens_per_s: float
    finished_last_minute: int
    failed_last_minute: int
    queued_by_class: dict[str, int]
    waiting_keys: dict[str, int]  # "<class>:<key>" -> its jobs near the heads of the model's queues
    adapters: list[str] = field(default_factory=list)  # the LoRA adapters its live workers serve


@dataclass(frozen=True)
class FleetStatus:
    taken_at: float
    workers: list[WorkerRow]
    models: list[ModelRow]
    batches: list[BatchProgress] = field(default_factory=list)
    # On a Redis Cluster, each store ("store 1" the fleet's own) with its hash tag and the id of the node
    # that serves it now (CLUSTER MYID)
    stores: list[dict[str, str]] = field(default_factory=list)


def register(subparsers: Subparsers) -> None:
    status = subparsers.add_parser(
        "status",
        help="the fleet at a glance: workers, queues, jobs of the last minute",
        description="Print the live workers (model, device, slots, jobs in flight, tokens/s, heartbeat age) "
        "and each model's queue depth and jobs finished and failed in the last minute. Reads Redis only.",
    )
    _add_redis_url(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(func=run_status)
    top = subparsers.add_parser(
        "top",
        help="the fleet live, refreshed every few seconds (Ctrl-C to quit)",
        description="`ortfleet status`, refreshed in place until Ctrl-C.",
    )
    _add_redis_url(top)
    top.add_argument(
        "--interval", metavar="SECONDS", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--iterations", metavar="N", type=int, default=0, help="stop after N refreshes (default: never)"
    )
    top.set_defaults(func=run_top)


def _add_redis_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="read this Redis only (default: ORTFLEET_REDIS_URL and every Redis of ORTFLEET_REDIS_SHARDS)",
    )


def run_status(args: argparse.Namespace) -> int:
    stores = _stores(args)
    if stores is None:
        return 2
    urls = list(dict.fromkeys(store.url for store in stores))
    try:
        status = asyncio.run(_read_once(stores))
    except (RedisError, OSError) as e:
        print(f"ortfleet status: cannot read the fleet from Redis at {_shown(urls)}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(status), indent=2))
    else:
        print(render(status, _shown(urls)))
    return 0


def run_top(args: argparse.Namespace) -> int:
    stores = _stores(args)
    if stores is None:
        return 2
    urls = list(dict.fromkeys(store.url for store in stores))
    try:
        asyncio.run(_watch(stores, max(0.1, args.interval), args.iterations))
    except KeyboardInterrupt:
        pass
    except (RedisError, OSError) as e:
        print(f"ortfleet top: cannot read the fleet from Redis at {_shown(urls)}: {e}", file=sys.stderr)
        return 1
    return 0


def _stores(args: argparse.Namespace) -> list[Store] | None:
    """The stores to read: the Redis --redis-url names, else the fleet's and every store of its shard map
    (the models' own Redis servers, or their hash tags on a Redis Cluster)."""
    try:
        settings = FleetSettings() if not args.redis_url else FleetSettings(redis_url=args.redis_url)
    except ValidationError as e:
        print(f"ortfleet: invalid settings:\n{e}", file=sys.stderr)
        return None
    cluster = cluster_node(settings.redis_url.get_secret_value())
    return [settings.home_store(cluster)] if args.redis_url else settings.all_stores(cluster)


def _shown(urls: list[str]) -> str:
    return ", ".join(mask_url(url) for url in urls)


async def _read_once(stores: list[Store]) -> FleetStatus:
    redises = [(connect_store(store), store.keys) for store in stores]
    try:
        return await read_status(redises)
    finally:
        for redis, _keys in redises:
            await redis.aclose()


async def _watch(stores: list[Store], interval_s: float, iterations: int) -> None:
    redises = [(connect_store(store), store.keys) for store in stores]
    shown = _shown(list(dict.fromkeys(store.url for store in stores)))
    tty = sys.stdout.isatty()
    try:
        count = 0
        while True:
            status = await read_status(redises)
            frame = render(status, shown, width=shutil.get_terminal_size().columns if tty else None)
            print(CLEAR_SCREEN + frame if tty else frame + "\n", flush=True)
            count += 1
            if iterations and count >= iterations:
                return
            await asyncio.sleep(interval_s)
    finally:
        for redis, _keys in redises:
            await redis.aclose()


async def read_status(redises: Sequence[tuple[Redis, Keyspace]]) -> FleetStatus:
    """Workers with a live heartbeat, and every model known to the fleet with its queue and recent jobs,
    from each Redis (the first the fleet's own, with the batches), a model's figures summed over them."""
    now = time.time()
    entries: list[dict[str, str]] = []
    known: set[str] = set()
    for redis, keys in redises:
        entries += await live_workers(redis, keys)
        known |= set(await known_models(redis, keys))
    workers = sorted((_worker_row(entry, now) for entry in entries), key=lambda w: (w.model, w.id))
    names = sorted(known | {w.model for w in workers})
    queues = summed([await queue_stats(redis, keys, names, now) for redis, keys in redises])
    outcomes = summed([await recent_outcomes(redis, keys, names, now) for redis, keys in redises])
    models = []
    for name in names:
        serving = [w for w in workers if w.model == name]
        models.append(
            ModelRow(
                name=name,
                workers=len(serving),
                capacity=sum(w.capacity for w in serving),
                in_flight=sum(w.in_flight for w in serving),
                queued=queues[name].depth,
                oldest_wait_s=round(queues[name].oldest_wait_s, 3),
                tokens_per_s=round(sum(w.tokens_per_s for w in serving), 2),
                finished_last_minute=outcomes[name].finished,
                failed_last_minute=outcomes[name].failed,
                queued_by_class=queues[name].by_class,
                waiting_keys=queues[name].waiting_keys,
                adapters=sorted({a for w in serving for a in w.adapters}),
            )
        )
    stores = [
        {"store": f"store {i}", "tag": keys.shown, "node": await store_node(redis)}
        for i, (redis, keys) in enumerate(redises, 1)
        if keys.tag is not None
    ]
    return FleetStatus(now, workers, models, await active_batches(*redises[0]), stores)


def _worker_row(entry: dict[str, str], now: float) -> WorkerRow:
    return WorkerRow(
        id=entry.get("id", "?"),
        model=entry.get("model", "?"),
        device=entry.get("device", "?"),
        state=entry.get("state", "?"),
        capacity=int(entry.get("capacity", "0")),
        in_flight=int(entry.get("in_flight", "0")),
        tokens_per_s=float(entry.get("tokens_per_s", "0")),
        generated_tokens=int(entry.get("generated_tokens", "0")),
        heartbeat_age_s=round(max(0.0, now - float(entry.get("heartbeat_at", now))), 3),
        metrics_url=entry.get("metrics_url", ""),
        adapters=sorted(worker_adapters(entry)),
    )


def render(status: FleetStatus, redis_url: str, width: int | None = None) -> str:
    """The status as two tables (workers, then models), lines cut to `width` when given."""
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.taken_at))
    lines = [
        f"ortfleet  {taken}  {len(status.workers)} live worker(s), {len(status.models)} model(s)  "
        f"redis {redis_url}",
        "",
    ]
    if status.workers:
        lines += table(
            WORKER_COLUMNS,
            [
                [
                    w.id,
                    w.model,
                    w.device,
                    w.state,
                    str(w.capacity),
                    str(w.in_flight),
                    f"{w.tokens_per_s:.1f}",
                    f"{w.heartbeat_age_s:.1f} s ago",
                    w.metrics_url or "-",
                ]
                for w in status.workers
            ],
        )
    else:
        lines.append("no live worker")
    lines.append("")
    if status.models:
        lines += table(
            MODEL_COLUMNS,
            [
                [
                    m.name,
                    str(m.workers),
                    str(m.capacity),
                    str(m.in_flight),
                    str(m.queued),
                    f"{m.oldest_wait_s:.1f} s" if m.queued else "-",
                    f"{m.tokens_per_s:.1f}",
                    str(m.finished_last_minute),
                    str(m.failed_last_minute),
                ]
                for m in status.models
            ],
        )
        lines += _adapter_lines(status.models)
        lines += _waiting_lines(status.models)
    else:
        lines.append("no model is known to this fleet yet")
    if status.stores:
        lines.append("")
        lines += [f"{s['store']} {s['tag']} on cluster node {s['node']}" for s in status.stores]
    if status.batches:
        lines.append("")
        lines += table(
            BATCH_COLUMNS,
            [
                [
                    b.id,
                    b.owner or "-",
                    b.status,
                    str(b.answered),
                    str(b.total),
                    str(b.failed),
                    str(b.in_flight),
                    f"{max(0.0, status.taken_at - b.created_at):.0f} s",
                ]
                for b in status.batches
            ],
        )
    if width:
        lines = [line[:width] for line in lines]
    return "\n".join(lines)


def _adapter_lines(models: Sequence[ModelRow]) -> list[str]:
    """Per model whose workers serve LoRA adapters: their names."""
    return [f"{m.name} adapters: {', '.join(m.adapters)}" for m in models if m.adapters]


def _waiting_lines(models: Sequence[ModelRow]) -> list[str]:
    """Per model with waiting jobs: its queue by priority class and the keys waiting at its heads."""
    lines = []
    for m in models:
        if not m.queued:
            continue
        classes = ", ".join(f"{cls} {count}" for cls, count in m.queued_by_class.items())
        keys = ", ".join(f"{label} ({count})" for label, count in sorted(m.waiting_keys.items()))
        lines += ["", f"{m.name} queued: {classes}; waiting keys: {keys or '-'}"]
    return lines


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell; text left-aligned, figures right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = [all(_is_figure(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "  ".join(padded).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _is_figure(cell: str) -> bool:
    head = cell.split(" ", 1)[0]
    return head == "-" or head.replace(".", "", 1).isdigit()
