"""Which of a model's stores takes a job, when ORTFLEET_REDIS_SHARDS gives the model several.

Each store of a model is a Redis of its own with workers of its own (each worker serves one store), so
the gateway balances the model's load by where it places jobs: on the store with the fewest jobs (running
and queued) for its ready workers' rows, counting the jobs this gateway placed since its registry snapshot
was read (the snapshot, with each store's queue depth, is at most half a second old; the workers' counts in
it at most a heartbeat). A store with no ready worker takes a job only when no store has one
(ORTFLEET_QUEUE_WITHOUT_WORKERS), or, with that setting, after every store that has one refused it.

A store that could not be reached goes last for DOWN_S (its Redis failing over, or gone), so that the
model is served by the others meanwhile. A job with an `Idempotency-Key` tries the stores (those served, as
any job) in an order fixed by the key, from its home store (key_home), so that its retries go where the
first try went and find the job there.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from typing import TYPE_CHECKING

from gateway.fleet import FleetSnapshot

if TYPE_CHECKING:
    from gateway.shards import Shard

DOWN_S = 2.0  # how long a store that could not be reached goes last


class Placement:
    """A gateway's placements of jobs on stores since its last registry snapshot."""

    def __init__(self) -> None:
        self._placed: Counter[tuple[int, str]] = Counter()
        self._snapshot: FleetSnapshot | None = None
        self._down_until: dict[int, float] = {}  # id of a store's Redis client -> monotonic time

    def order(
        self,
        stores: list[Shard],
        model: str,
        snapshot: FleetSnapshot,
        idempotency_key: str | None,
        *,
        placing: bool = True,
        keep_idle: bool = False,
    ) -> list[Shard]:
        """The model's stores to try, the first first: those with a ready worker, and the others after them
        only with `keep_idle` (ORTFLEET_QUEUE_WITHOUT_WORKERS) or when none has one. When `placing` a job,
        it counts as placed on the first at once (so that submissions awaiting Redis together spread),
        until `moved` says where it went instead."""
        if len(stores) == 1:
            return stores
        if snapshot is not self._snapshot:  # the workers' counts are new: so are the placements beside them
            self._placed.clear()
            self._snapshot = snapshot
        load = {id(store): self._load(store, model, snapshot) for store in stores}
        if idempotency_key is not None:
            start = stores.index(key_home(stores, idempotency_key))
            ordered = stores[start:] + stores[:start]
        else:
            now = time.monotonic()
            ordered = sorted(
                stores, key=lambda store: (self._down_until.get(id(store.redis), 0.0) > now, load[id(store)])
            )
        served = [store for store in ordered if math.isfinite(load[id(store)])]
        if served and not keep_idle:  # a job never waits on a store nobody serves while one is served
            ordered = served
        if placing:
            self._placed[id(ordered[0].redis), model] += 1
        return ordered

    def moved(self, first: Shard, taken_by: Shard | None, model: str) -> None:
        """The job counted on `first` went to `taken_by` (None: to no store)."""
        if taken_by is first:
            return
        if self._placed[id(first.redis), model] > 0:
            self._placed[id(first.redis), model] -= 1
        if taken_by is not None:
            self._placed[id(taken_by.redis), model] += 1

    def unreachable(self, store: Shard) -> None:
        """The store's Redis did not answer a submission: it goes last for DOWN_S."""
        self._down_until[id(store.redis)] = time.monotonic() + DOWN_S

    def _load(self, store: Shard, model: str, snapshot: FleetSnapshot) -> float:
        state = snapshot.by_store.get((id(store.redis), model))
        if state is None or state.ready == 0 or state.capacity == 0:
            return math.inf
        return (state.in_flight + state.queued + self._placed[id(store.redis), model]) / state.capacity


def key_home(stores: list[Shard], idempotency_key: str) -> Shard:
    """The store an idempotency key's job tries first, fixed by the key: it also lists the other stores a
    try of the key went to (gateway/idempotency.py)."""
    return stores[int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:8], "big") % len(stores)]


def share_of_limit(limit: int, stores: int) -> int:
    """A key's limit on one of a model's `stores` (0: none): its even share, rounded up, so that the key's
    jobs spread over the stores can reach the whole limit (a little over it when it does not divide)."""
    return limit if limit <= 0 or stores == 1 else -(-limit // stores)
