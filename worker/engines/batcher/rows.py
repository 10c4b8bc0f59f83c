"""The batcher's rows and the slots they hold.

A request waits until a slot is free and the KV budget holds its prompt plus max_tokens (first come,
first served), prefills in a slot, then decodes. Decode rows hold the slots [0, rows) (a run binds them
as one tensor); a prefilling row holds a slot above them and moves down when its prompt is in; a row that
ends is replaced by the last one. With the prefix cache on, a row starts in the free slot that holds the
longest cached prefix of its prompt in its cache scope, and a row that ends leaves its prompt's KV in the
slot it frees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.engine import GenerationRequest, GenerationStream, TokenLogprobs
from worker.engines.batcher.counters import BatcherCounters
from worker.engines.batcher.graph import Layout
from worker.engines.batcher.kv_slots import KvSlots
from worker.engines.batcher.prefix_cache import PrefixCache
from worker.engines.batcher.sampler import RowSampler


@dataclass(eq=False)
class Row:
    stream: GenerationStream
    sampler: RowSampler
    reserved: int  # KV tokens held in the budget
    slot: int = -1
    length: int = 0  # tokens in the row's KV
    next_token: int = -1  # fed at the row's next decode step
    produced: int = 0  # tokens generated after the replayed ones
    replayed: int = 0
    exact: bool = True
    first_update: bool = True
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when the request asks for them

    @property
    def request(self) -> GenerationRequest:
        return self.stream.request

    @property
    def cache_scope(self) -> str:
        """The prefix cache's scope: the request's, and its adapter's (another adapter's KV differs)."""
        adapter = self.request.adapter
        return self.request.cache_scope if adapter is None else f"{self.request.cache_scope}\0lora:{adapter}"

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.length

    @property
    def replaying(self) -> bool:
        return self.replayed < len(self.request.replay_ids)


class Rows:
    """Owns the rows, the KV slots and the prefix cache (on the batcher's thread; the counts are read
    from any thread)."""

    def __init__(
        self,
        layout: Layout,
        capacity: int,
        context_length: int,
        kv_budget_tokens: int,
        prefixes: PrefixCache | None,
        counters: BatcherCounters,
    ) -> None:
        self._layout = layout
        self.capacity = capacity
        self.kv = KvSlots(layout, capacity, context_length, kv_budget_tokens)
        self.prefixes = prefixes
        self._counters = counters
        self.waiting: deque[Row] = deque()
        self.prefilling: list[Row] = []
        self.decoding: list[Row] = []  # row i holds slot i

    def reset(self) -> None:
        """Fresh KV slots and an empty prefix cache, with no row (after a failure)."""
        self.kv = KvSlots(self._layout, self.capacity, self.kv.context_length, self.kv.budget_tokens)
        if self.prefixes is not None:
            self.prefixes.clear()

    def every(self) -> list[Row]:
        return [*self.waiting, *self.prefilling, *self.decoding]

    def clear(self) -> list[Row]:
        """Takes every row out (their KV can no longer be trusted) and returns them."""
        rows = self.every()
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()
        return rows

    def running(self) -> int:
        """Rows in the batch: prefilling or decoding."""
        return len(self.prefilling) + len(self.decoding)

    def admit(self) -> None:
        """Waiting rows into free slots, first come first served, while the KV budget holds them."""
        while self.waiting and self.running() < self.capacity and self.kv.fits(self.waiting[0].reserved):
            row = self.waiting.popleft()
            held = {r.slot for r in self.prefilling} | set(range(len(self.decoding)))
            free = set(range(self.capacity)) - held
            self._take_slot(row, free)
            self.kv.reserve(row.reserved)
            self.prefilling.append(row)

    def _take_slot(self, row: Row, free: set[int]) -> None:
        """The slot holding the longest cached prefix of the row's prompt, from which it prefills the
        rest; else a free slot, from the top (prefix_cache.py)."""
        if self.prefixes is None:
            row.slot = max(free)
            return
        if row.request.prompt_logprobs is not None:  # every prompt position's logits are needed
            slot, reused = None, 0
        else:
            slot, reused = self.prefixes.match(row.request.prompt_ids, row.cache_scope, free)
        self._counters.prefix_tokens_queried += len(row.request.prompt_ids)
        if slot is None:
            slot = self.prefixes.victim(free, row.cache_scope)
        else:
            row.length = row.cached = reused
            self._counters.prefix_hits += 1
            self._counters.prefix_tokens_reused += reused
        self.prefixes.forget(slot)
        row.slot = slot

    def end(self, row: Row) -> None:
        """Takes the row out of the batch and gives back its slot and KV."""
        if row in self.waiting:
            self.waiting.remove(row)
            return
        self.kv.release(row.reserved)
        if row in self.prefilling:
            self.prefilling.remove(row)
            return
        last = self.decoding[-1]
        kept = 0 if self.prefixes is None else self.prefixes.usable(row.request.prompt_ids)
        if last is not row:  # the last decode row fills the gap; the ended row's prompt KV takes its slot
            if kept:
                self.kv.swap(last.slot, last.length, row.slot, kept)
            else:
                self.kv.move(last.slot, row.slot, last.length)
            row.slot, last.slot = last.slot, row.slot
            self.decoding[last.slot] = last
        self.decoding.pop()
        if self.prefixes is not None:
            self.prefixes.keep(row.slot, row.request.prompt_ids, row.cache_scope)

    def join_decoding(self, row: Row) -> None:
        """The row's prompt is in: its KV moves down to the slot where the decode rows end."""
        self.prefilling.remove(row)
        target = len(self.decoding)
        if row.slot != target:
            other = next((r for r in self.prefilling if r.slot == target), None)
            cached = 0 if self.prefixes is None else self.prefixes.length(target)
            if other is not None:  # a prefilling row sits where the decode rows end: they trade slots
                self.kv.swap(row.slot, row.length, target, other.length)
                other.slot = row.slot
            elif cached:  # a cached prefix sits there: it moves to the row's slot
                self.kv.swap(row.slot, row.length, target, cached)
                assert self.prefixes is not None
                self.prefixes.moved(target, row.slot)
            else:
                self.kv.move(row.slot, target, row.length)
            row.slot = target
        self.decoding.append(row)
