"""Prompts' KV left in the batcher's free slots, so that a request whose prompt starts the same way starts
from it and prefills only the rest.

When a row that finished its prefill ends, its slot keeps the KV of its prompt's whole prefill chunks.
A new request takes the free slot that holds the longest prefix of its prompt, counted in whole chunks
and short of its last token (whose logits it needs), and prefills from there. Chunks sit at fixed offsets
of a prompt and a prefill runs one prompt alone, so the KV reused is the KV the request would compute
itself: a reused prefix changes no token of the output. The KV of generated tokens, computed one decode
step at a time in batches, is never reused.

Entries live only in free slots: a slot a request takes is no longer cached, and the least recently
used entry is the first a request without a match overwrites. So the cache holds at most
`slots - rows running` prompts and costs no memory beyond the KV slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class _Entry:
    tokens: np.ndarray  # the prompt tokens whose KV the slot holds: whole chunks
    used: int  # when it was last kept or matched (the cache's clock)


class PrefixCache:
    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._entries: dict[int, _Entry] = {}
        self._clock = 0

    @property
    def tokens(self) -> int:
        """Tokens of KV held for reuse."""
        return sum(entry.tokens.size for entry in self._entries.values())

    def length(self, slot: int) -> int:
        entry = self._entries.get(slot)
        return 0 if entry is None else int(entry.tokens.size)

    def keep(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """The slot's row ended with its whole prompt prefilled: its whole chunks stay for reuse."""
        usable = self.usable(prompt_ids)
        self._clock += 1
        if usable:
            self._entries[slot] = _Entry(np.asarray(prompt_ids[:usable], np.int64), self._clock)
        else:
            self._entries.pop(slot, None)

    def usable(self, prompt_ids: Sequence[int]) -> int:
        """How many tokens of this prompt a kept entry of it would hold."""
        return self._whole_chunks(len(prompt_ids))

    def _whole_chunks(self, tokens: int) -> int:
        return tokens // self.chunk * self.chunk

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

    def match(self, prompt_ids: Sequence[int], free: Iterable[int]) -> tuple[int | None, int]:
        """The free slot holding the longest reusable prefix of the prompt, and its length (None, 0: no
        slot holds a whole chunk of it)."""
        prompt = np.asarray(prompt_ids, np.int64)
        best: tuple[int | None, int] = (None, 0)
        for slot in free:
            entry = self._entries.get(slot)
            if entry is None:
                continue
            most = min(entry.tokens.size, prompt.size - 1)  # the last prompt token is always run
            same = entry.tokens[:most] == prompt[:most]
            common = most if bool(same.all()) else int(np.argmin(same))
            reusable = self._whole_chunks(common)
            if reusable > best[1]:
                best = (slot, reusable)
        if best[0] is not None:
            self._clock += 1
            self._entries[best[0]].used = self._clock
        return best

    def victim(self, free: Iterable[int]) -> int:
        """The free slot a request without a match takes: an empty one (the highest), else the one whose
        entry was used longest ago."""
        slots = sorted(free, reverse=True)
        empty = [slot for slot in slots if slot not in self._entries]
        if empty:
            return empty[0]
        return min(slots, key=lambda slot: self._entries[slot].used)
