"""Which of a model's stores takes a job, when ORTFLEET_REDIS_SHARDS gives the model several.

Each store of a model is a Redis of its own with workers of its own (each worker serves one store), so
the gateway balances the model's load by where it places jobs: on the store with the fewest jobs (running
and queued) for its ready workers' rows, counting the jobs this gateway placed that its registry snapshot
cannot show: those still being submitted, and those submitted since the snapshot's read began (the
snapshot, with each store's queue depth, is at most half a second old; the workers' counts in it at most a
heartbeat). A burst of submissions thus spreads over the stores, whichever snapshot each one reads. A
store with no ready worker takes a job only when no store has one (ORTFLEET_QUEUE_WITHOUT_WORKERS), or,
with that setting, after every store that has one refused it.

A store that could not be reached goes last for DOWN_S (its Redis failing over, or gone), so that the
model is served by the others meanwhile. A job with an `Idempotency-Key` tries the stores (those served, as
any job) in an order fixed by the key, from its home store (key_home), so that its retries go where the
first try went and find the job there.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING

from common.error_codes import ErrorCode
from gateway.errors import ApiError
from gateway.fleet import FleetSnapshot

if TYPE_CHECKING:
    from gateway.shards import Shard

DOWN_S = 2.0  # how long a store that could not be reached goes last
KEPT_S = 30.0  # how long a placement is counted at most (one whose submission never said where it went)


class Placement:
    """A gateway's placements of jobs on stores that its registry snapshot may not show yet."""

    def __init__(self) -> None:
        # (id of a store's Redis client, model) -> monotonic times: of the placements being submitted (when
        # ordered), and of those submitted (when the store took them), oldest first
        self._submitting: defaultdict[tuple[int, str], deque[float]] = defaultdict(deque)
        self._submitted: defaultdict[tuple[int, str], deque[float]] = defaultdict(deque)
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
        now = time.monotonic()
        load = {id(store): self._load(store, model, snapshot, now) for store in stores}
        if idempotency_key is not None:
            start = stores.index(key_home(stores, idempotency_key))
            ordered = stores[start:] + stores[:start]
        else:
            ordered = sorted(
                stores, key=lambda store: (self._down_until.get(id(store.redis), 0.0) > now, load[id(store)])
            )
        served = [store for store in ordered if math.isfinite(load[id(store)])]
        if served and not keep_idle:  # a job never waits on a store nobody serves while one is served
            ordered = served
        if placing:
            self._submitting[id(ordered[0].redis), model].append(now)
        return ordered

    def moved(self, first: Shard, taken_by: Shard | None, model: str) -> None:
        """The job counted on `first` at its order was submitted: to `taken_by` (None: to no store). It
        counts there until a registry snapshot read after that shows it."""
        submitting = self._submitting[id(first.redis), model]
        if submitting:
            submitting.popleft()
        if taken_by is not None:
            self._submitted[id(taken_by.redis), model].append(time.monotonic())

    def unreachable(self, store: Shard) -> None:
        """The store's Redis did not answer a submission: it goes last for DOWN_S."""
        self._down_until[id(store.redis)] = time.monotonic() + DOWN_S

    def _load(self, store: Shard, model: str, snapshot: FleetSnapshot, now: float) -> float:
        state = snapshot.by_store.get((id(store.redis), model))
        if state is None or state.ready == 0 or state.capacity == 0:
            return math.inf
        return (state.in_flight + state.queued + self._unseen(id(store.redis), model, snapshot, now)) / (
            state.capacity
        )

    def _unseen(self, redis: int, model: str, snapshot: FleetSnapshot, now: float) -> int:
        """This gateway's jobs on the store that the snapshot does not count: those being submitted, and
        those submitted after its read began (before it, its queue depth or its workers count them)."""
        submitting, submitted = self._submitting[redis, model], self._submitted[redis, model]
        while submitting and submitting[0] < now - KEPT_S:
            submitting.popleft()
        while submitted and submitted[0] < snapshot.read_at:
            submitted.popleft()
        return len(submitting) + len(submitted)


def key_home(stores: list[Shard], idempotency_key: str) -> Shard:
    """The store an idempotency key's job tries first, fixed by the key: it also lists the other stores a
    try of the key went to (gateway/idempotency.py)."""
    return stores[int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:8], "big") % len(stores)]


def share_of_limit(limit: int, stores: int) -> int:
    """A key's limit on one of a model's `stores` (0: none): its even share, rounded up, so that the key's
    jobs spread over the stores can reach the whole limit (a little over it when it does not divide)."""
    return limit if limit <= 0 or stores == 1 else -(-limit // stores)


def check_choices_fit(choices: int, limit: int, stores: int, model: str) -> None:
    """400 `too_many_choices` when a request's `choices` (which all go to one of the model's `stores`)
    exceed the share of the key's active-job `limit` that one store holds: it could never be admitted, and
    a 429 would be retried without end."""
    share = share_of_limit(limit, stores)
    if not share or choices <= share:
        return
    message = f"n: {choices} choices requested, more than this key's {limit} active jobs"
    if share < limit:
        message = (
            f"n: {choices} choices requested, more than the {share} active jobs this key may hold on one "
            f"store of model {model!r}: its limit of {limit} is shared out over the model's {stores} "
            "stores, and a request's choices all go to one"
        )
    raise ApiError(400, message, param="n", code=ErrorCode.too_many_choices)
