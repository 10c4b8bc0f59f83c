"""Prompts' KV left in the batcher's free slots, so that a request whose prompt starts the same way, in the
same cache scope, starts from it and prefills only the rest.

When a row that finished its prefill ends, its slot keeps the KV of its prompt's whole prefill chunks.
A new request takes the free slot that holds the longest prefix of its prompt, counted in whole chunks
and short of its last token (whose logits it needs), and prefills from there. Chunks sit at fixed offsets
of a prompt and a prefill runs one prompt alone, so the KV reused is the KV the request would compute
itself: a reused prefix changes no token of the output. The KV of generated tokens, computed one decode
step at a time in batches, is never reused.

A prompt is known by its blocks: the digest of each whole chunk, chained to the chunk before it and the
first to the request's cache scope (the job's API key or shared group, and its cache_salt; see
gateway/cache_scope.py). Two prompts share a block only if their scopes and every token up to the block's
end are the same, so a request never reuses, counts or is sped up by another scope's prompt.

Entries live only in free slots: a slot a request takes is no longer cached. A request without a match
takes an empty slot, else the least recently used entry of the scope holding the most blocks (its own
first when it holds as many as the largest): no scope keeps more than a fair share of the cache while
another wants room, and no scope evicts one that holds less than it does. So the cache holds at most
`slots - rows running` prompts and costs no memory beyond the KV slots.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_SEED = b"ortfleet prefix scope\0"


def prompt_blocks(scope: str, prompt_ids: Sequence[int], chunk: int) -> tuple[bytes, ...]:
    """The digest of each whole chunk of the prompt: of the scope and every token up to the chunk's end."""
    tokens = np.asarray(prompt_ids, np.int64)
    chained = hashlib.sha256(_SEED + scope.encode())
    blocks = []
    for start in range(0, tokens.size // chunk * chunk, chunk):
        chained.update(tokens[start : start + chunk].tobytes())
        blocks.append(chained.copy().digest())
    return tuple(blocks)


@dataclass
class _Entry:
    scope: str
    blocks: tuple[bytes, ...]  # the prompt's whole chunks whose KV the slot holds
    used: int  # when it was last kept or matched (the cache's clock)


class PrefixCache:
    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._entries: dict[int, _Entry] = {}
        self._clock = 0

    @property
    def tokens(self) -> int:
        """Tokens of KV held for reuse."""
        return sum(len(entry.blocks) for entry in self._entries.values()) * self.chunk

    def length(self, slot: int) -> int:
        entry = self._entries.get(slot)
        return 0 if entry is None else len(entry.blocks) * self.chunk

    def keep(self, slot: int, prompt_ids: Sequence[int], scope: str) -> None:
        """The slot's row ended with its whole prompt prefilled: its whole chunks stay for reuse."""
        blocks = prompt_blocks(scope, prompt_ids, self.chunk)
        self._clock += 1
        if blocks:
            self._entries[slot] = _Entry(scope, blocks, self._clock)
        else:
            self._entries.pop(slot, None)

    def usable(self, prompt_ids: Sequence[int]) -> int:
        """How many tokens of this prompt a kept entry of it would hold."""
        return len(prompt_ids) // self.chunk * self.chunk

    def forget(self, slot: int) -> None:
        """The slot is taken (or its KV overwritten)."""
        self._entries.pop(slot, None)

    def moved(self, source: int, target: int) -> None:
        """The KV of slot `source` now sits in slot `target`."""
        entry = self._entries.pop(source, None)
        if entry is not None:
            self._entries[target] = entry

    def clear(self) -> None:
        self._entries.clear()

    def drop_scopes(self, suffix: str) -> None:
        """Forgets the prompts of every scope ending in `suffix` (an unloaded adapter's: rows.py's)."""
        for slot in [slot for slot, entry in self._entries.items() if entry.scope.endswith(suffix)]:
            del self._entries[slot]

    def match(self, prompt_ids: Sequence[int], scope: str, free: Iterable[int]) -> tuple[int | None, int]:
        """The free slot holding the longest reusable prefix of the prompt in this scope, and its length
        (None, 0: no slot holds a whole chunk of it)."""
        wanted = prompt_blocks(scope, prompt_ids[:-1], self.chunk)  # the last prompt token is always run
        best: tuple[int | None, int] = (None, 0)
        for slot in free:
            entry = self._entries.get(slot)
            if entry is None:
                continue
            common = _common_blocks(entry.blocks, wanted)
            if common * self.chunk > best[1]:
                best = (slot, common * self.chunk)
        if best[0] is not None:
            self._clock += 1
            self._entries[best[0]].used = self._clock
        return best

    def victim(self, free: Iterable[int], scope: str) -> int:
        """The free slot a request of `scope` without a match takes: an empty one (the highest), else the
        least recently used entry of the scope holding the most blocks, the request's own scope first
        among those holding as many."""
        slots = sorted(free, reverse=True)
        empty = [slot for slot in slots if slot not in self._entries]
        if empty:
            return empty[0]
        held = self._held()

        def eviction_order(slot: int) -> tuple[int, bool, int]:
            entry = self._entries[slot]
            return held[entry.scope], entry.scope == scope, -entry.used

        return max(slots, key=eviction_order)

    def _held(self) -> Counter[str]:
        held: Counter[str] = Counter()
        for entry in self._entries.values():
            held[entry.scope] += len(entry.blocks)
        return held


def _common_blocks(kept: tuple[bytes, ...], wanted: tuple[bytes, ...]) -> int:
    """Leading blocks the two share (chained digests: once one differs, every later one does)."""
    common = 0
    for ours, theirs in zip(kept, wanted, strict=False):
        if ours != theirs:
            break
        common += 1
    return common
