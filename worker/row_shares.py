"""Keys' shares of a worker's rows: a key's share is the rows in proportion to its weight among the keys
that hold a row or wait for one (the weights fair share gives their tokens). A key above its share yields
a row to a waiting job whose key, given that row, stays within its own; the row it yields is the one whose
preemption loses least."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from common.jobs.reads import WaitingJob

_SLACK = 1e-9  # shares are fractions of rows: a key at its share exactly is within it


@dataclass(frozen=True)
class Row:
    """An interactive job running on the worker, as the choice of a row to yield sees it."""

    job_id: str
    owner: str
    weight: float
    preemptions: int  # times the job was preempted before
    lost_tokens: int  # what a preemption costs it: its prompt and the tokens it has, computed again
    started_at: float  # when its attempt started (wall clock)


@dataclass(frozen=True)
class Handover:
    """`row` gives way to `job`; `eligible` waiting jobs (of those read) could take a row within their
    keys' shares."""

    row: Row
    job: WaitingJob
    eligible: int


def shares(capacity: int, weights: dict[str, float]) -> dict[str, float]:
    """Each key's share of `capacity` rows, in proportion to its weight."""
    total = sum(weights.values())
    return {owner: capacity * weight / total for owner, weight in weights.items()}


def handover(
    rows: list[Row], waiting: list[WaitingJob], capacity: int, protected: Callable[[Row], bool]
) -> Handover | None:
    """The row to give a waiting job of another key, when a key holds more than its share: taken from the
    key furthest above its share that has a row not `protected`, for the first waiting job (in queue
    order) whose key holds less than its share; among that key's rows the one preempted fewest times,
    then the one that loses fewest tokens, then the latest started. None when every key is within its
    share, or no job waits that a row could go to within its key's."""
    held = Counter(row.owner for row in rows)
    weights: dict[str, float] = {}
    for owner, weight in [*((r.owner, r.weight) for r in rows), *((j.owner, j.weight) for j in waiting)]:
        weights[owner] = max(weights.get(owner, 0.0), weight)
    share = shares(capacity, weights)
    room = {owner: int(share[owner] + _SLACK) - held[owner] for owner in share}
    eligible: list[WaitingJob] = []
    for job in waiting:
        if room[job.owner] > 0:
            room[job.owner] -= 1
            eligible.append(job)
    if not eligible:
        return None
    above = sorted((o for o in held if held[o] > share[o] + _SLACK), key=lambda o: share[o] - held[o])
    for owner in above:
        yielding = [row for row in rows if row.owner == owner and not protected(row)]
        if yielding:
            row = min(yielding, key=lambda r: (r.preemptions, r.lost_tokens, -r.started_at))
            return Handover(row, eligible[0], len(eligible))
    return None
