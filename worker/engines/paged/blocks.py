"""The paged KV cache's blocks: which of the pool's blocks each row's tokens live in (its block table),
what each row has reserved, and the prompt blocks kept for reuse.

- **Reservations.** A row is admitted only when the pool can hold its whole length (prompt plus
  max_new_tokens, in blocks, less the blocks it reuses): a running row never runs out of KV, the rule of
  the CPU batcher's budget (worker/engines/batcher/kv_slots.py). Its blocks are taken as it grows
  (`grow`), from its reservation.
- **Prefix reuse.** A block whose tokens are all prompt tokens, once computed (`computed`), is known by the
  digest of its scope and every token up to its end (the CPU batcher's `prompt_blocks`, with the block as
  the chunk): a later row of the same scope whose prompt starts the same way shares it instead of
  computing it again, in whole blocks and short of its prompt's last token (whose logits it needs). A
  shared block is full, so no row ever writes to it: no copy on write.
- **The cache.** A computed prompt block outlives its rows: with no row left it is free but kept, and taken
  back by the first row that needs a block when no empty one is left: the least recently used block of
  the scope that keeps the most (the CPU cache's fairness: no scope holds more than its share while
  another wants room).

Blocks are numbered 0 to blocks - 1; a row's table lists its blocks in token order (token t of the row is
at offset t % block_size of block table[t // block_size]).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.engines.batcher.prefix_cache import prompt_blocks


class OutOfBlocks(RuntimeError):
    """A row asked for more than it reserved, or a row was admitted past what the pool holds."""


@dataclass
class _Row:
    scope: str
    digests: tuple[bytes, ...]  # its prompt's whole blocks, by digest
    table: list[int] = field(default_factory=list)
    tokens: int = 0  # tokens its table holds room for and that it has written or reused
    reserved: int = 0  # blocks it may still take
    registered: int = 0  # of its prompt blocks, those known to the cache


class BlockManager:
    def __init__(self, blocks: int, block_size: int) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs blocks and a block size of at least 1, not {blocks} x {block_size}"
            )
        self.blocks = blocks
        self.block_size = block_size
        self._empty = list(range(blocks - 1, -1, -1))  # never used, or evicted: taken from the end
        self._users = [0] * blocks  # rows whose tables hold each block
        self._digest: dict[int, bytes] = {}  # cached block -> its digest
        self._scope: dict[int, str] = {}  # cached block -> its scope
        self._cached: dict[bytes, int] = {}  # digest -> cached block
        self._idle: dict[int, int] = {}  # cached blocks no row holds -> when the last one let go
        self._clock = 0
        self._rows: dict[int, _Row] = {}
        self._reserved = 0  # blocks the rows may still take, all together

    # What the scheduler asks.

    @property
    def available(self) -> int:
        """Blocks a new reservation may count on: the empty ones and the idle cached ones, less what the
        running rows reserved."""
        return len(self._empty) + len(self._idle) - self._reserved

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def needs(self, prompt_ids: Sequence[int], max_new_tokens: int, scope: str) -> tuple[int, int]:
        """(blocks a row would reserve, prompt tokens it would reuse) were it admitted now."""
        digests = prompt_blocks(scope, prompt_ids, self.block_size)
        reused = self._reusable(digests, len(prompt_ids))
        total = math.ceil((len(prompt_ids) + max_new_tokens) / self.block_size)
        idle_reused = sum(1 for digest in digests[:reused] if self._cached[digest] in self._idle)
        # Reusing an idle block takes it out of what others may count on, as a new block would.
        return total - reused + idle_reused, reused * self.block_size

    def fits(self, prompt_ids: Sequence[int], max_new_tokens: int, scope: str) -> bool:
        return self.needs(prompt_ids, max_new_tokens, scope)[0] <= self.available

    # A row's life.

    def admit(self, row: int, prompt_ids: Sequence[int], max_new_tokens: int, scope: str = "") -> int:
        """Takes the row in, its whole length reserved; the prompt tokens it reuses from the cache (whole
        blocks at its start, its table already holding them)."""
        if row in self._rows:
            raise ValueError(f"row {row} is already admitted")
        digests = prompt_blocks(scope, prompt_ids, self.block_size)
        reused = self._reusable(digests, len(prompt_ids))
        total = math.ceil((len(prompt_ids) + max_new_tokens) / self.block_size)
        idle_reused = sum(1 for digest in digests[:reused] if self._cached[digest] in self._idle)
        if total - reused + idle_reused > self.available:
            raise OutOfBlocks(
                f"row {row} needs {total - reused} new blocks and the pool has {self.available} to give"
            )
        entry = _Row(scope, digests, registered=reused)
        for digest in digests[:reused]:
            block = self._cached[digest]
            self._hold(block)
            entry.table.append(block)
        self._clock += 1
        entry.tokens = reused * self.block_size
        entry.reserved = total - reused
        self._reserved += entry.reserved
        self._rows[row] = entry
        return entry.tokens

    def grow(self, row: int, tokens: int) -> list[int]:
        """Room for `tokens` more tokens of the row (from its reservation); its table."""
        entry = self._rows[row]
        if entry.tokens + tokens <= len(entry.table) * self.block_size:  # its last block has room
            entry.tokens += tokens
            return entry.table
        wanted = math.ceil((entry.tokens + tokens) / self.block_size) - len(entry.table)
        if wanted > entry.reserved:
            raise OutOfBlocks(f"row {row} grows past its reservation ({entry.reserved} blocks left)")
        for _ in range(wanted):
            block = self._take()
            self._users[block] = 1
            entry.table.append(block)
        entry.reserved -= max(wanted, 0)
        self._reserved -= max(wanted, 0)
        entry.tokens += tokens
        return entry.table

    def grow_each_by_one(self, rows: Sequence[int]) -> list[list[int]]:
        """Room for one more token of each row (a step of decodes); their tables. `grow`, with the rows
        whose last block has room answered in the loop."""
        tables = []
        entries, size = self._rows, self.block_size
        for row in rows:
            entry = entries[row]
            if entry.tokens < len(entry.table) * size:
                entry.tokens += 1
                tables.append(entry.table)
            else:
                tables.append(self.grow(row, 1))
        return tables

    def computed(self, row: int, tokens: int) -> None:
        """The row's first `tokens` tokens have their KV in its blocks: its whole prompt blocks among
        them are offered to the cache (where another row of its scope cached one first, that one stays)."""
        entry = self._rows[row]
        if entry.registered >= len(entry.digests):  # every whole prompt block offered already
            return
        whole = min(tokens // self.block_size, len(entry.digests))
        for index in range(entry.registered, whole):
            digest = entry.digests[index]
            if digest not in self._cached:
                block = entry.table[index]
                self._cached[digest] = block
                self._digest[block] = digest
                self._scope[block] = entry.scope
        entry.registered = max(entry.registered, whole)

    def table(self, row: int) -> list[int]:
        return self._rows[row].table

    def release(self, row: int) -> None:
        """The row ended (finished, cancelled or preempted): its blocks go back, its cached prompt
        blocks kept for the next rows, its unused reservation freed."""
        entry = self._rows.pop(row)
        self._reserved -= entry.reserved
        self._clock += 1
        for block in entry.table:
            self._users[block] -= 1
            if self._users[block]:
                continue
            if block in self._digest:
                self._idle[block] = self._clock
            else:
                self._empty.append(block)

    # The pool's own.

    def _reusable(self, digests: tuple[bytes, ...], prompt_tokens: int) -> int:
        """Whole cached blocks at the prompt's start, short of its last token."""
        usable = (prompt_tokens - 1) // self.block_size
        count = 0
        while count < min(usable, len(digests)) and digests[count] in self._cached:
            count += 1
        return count

    def _hold(self, block: int) -> None:
        self._users[block] += 1
        self._idle.pop(block, None)

    def _take(self) -> int:
        if self._empty:
            return self._empty.pop()
        if not self._idle:
            raise OutOfBlocks("the pool is empty")  # the reservations make this unreachable
        held = Counter(self._scope[block] for block in self._cached.values())
        block = min(self._idle, key=lambda b: (-held[self._scope[b]], self._idle[b]))
        del self._idle[block]
        del self._cached[self._digest.pop(block)]
        del self._scope[block]
        return block

    def check(self) -> None:
        """Raises AssertionError when the books do not balance (for tests)."""
        users = Counter(block for entry in self._rows.values() for block in entry.table)
        assert all(users[block] == self._users[block] for block in range(self.blocks)), "users"
        assert set(self._idle) == {b for b in self._digest if not self._users[b]}, "idle"
        assert not set(self._empty) & set(users) and not set(self._empty) & set(self._digest), "empty"
        assert len(self._empty) + len(self._idle) + sum(1 for n in self._users if n) == self.blocks, "count"
        assert self._reserved == sum(entry.reserved for entry in self._rows.values()), "reserved"
        assert self._reserved <= len(self._empty) + len(self._idle), "over-reserved"
        assert all(self._cached[self._digest[b]] == b for b in self._digest), "digests"
