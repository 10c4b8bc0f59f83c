"""The KV cache of the batcher's rows: one buffer per layer and key/value, [slots, kv_heads, context,
head], shared by every row (a row holds one slot), and the worker's KV budget in tokens.

The buffers are allocated once, zeroed lazily by the OS (np.zeros maps fresh pages): a slot costs memory
only for the tokens written to it, so a request without max_tokens allocates and zero-fills nothing on
its path. A budget bounds what the admitted requests may write: each reserves its prompt plus its
max_tokens when it is admitted, and gives them back when it ends.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.graph import Layout


class KvSlots:
    def __init__(self, layout: Layout, slots: int, context_length: int, budget_tokens: int) -> None:
        self.slots, self.context_length, self.budget_tokens = slots, context_length, budget_tokens
        shape = (slots, layout.kv_heads, context_length, layout.head_size)
        self._buffers = [np.zeros(shape, np.float32) for _ in layout.past_names]
        self._values: dict[tuple[int, int], list[ort.OrtValue]] = {}
        self.reserved = 0  # tokens reserved by the admitted requests

    @property
    def bytes_per_token(self) -> int:
        buffer = self._buffers[0]
        return len(self._buffers) * buffer.shape[1] * buffer.shape[3] * buffer.itemsize

    def values(self, start: int, stop: int) -> list[ort.OrtValue]:
        """The slots [start, stop) of every buffer as OrtValues (contiguous: slots are the first axis)."""
        values = self._values.get((start, stop))
        if values is None:
            values = self._values[(start, stop)] = [
                ort.OrtValue.ortvalue_from_numpy(buffer[start:stop]) for buffer in self._buffers
            ]
        return values

    def move(self, source: int, target: int, length: int) -> None:
        """Copies the first `length` tokens of slot `source` to slot `target`."""
        for buffer in self._buffers:
            buffer[target, :, :length] = buffer[source, :, :length]

    def swap(self, a: int, length_a: int, b: int, length_b: int) -> None:
        for buffer in self._buffers:
            held = buffer[a, :, :length_a].copy()
            buffer[a, :, :length_b] = buffer[b, :, :length_b]
            buffer[b, :, :length_a] = held

    def fits(self, tokens: int) -> bool:
        return self.reserved + tokens <= self.budget_tokens

    def reserve(self, tokens: int) -> None:
        self.reserved += tokens

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
