"""Rows of different lengths decoding in one onnxruntime run per step, with KV buffers owned here.

The graph ORT-GenAI's builder writes for GroupQueryAttention models takes `input_ids`, an
`attention_mask` and `past_key_values.N.key|value` [batch, kv_heads, past, head]; it derives each row's
length from the mask's row sum (seqlens_k = sum - 1) and the rotary positions from that length, so rows
are right-padded: row b's KV sits at [0, length_b) and its new token's KV is written at length_b.
Three ways to hand the KV over:
- `run`: `InferenceSession.run` with numpy past in, present out (ORT copies past into a present one
  longer, and the present comes back to numpy);
- `bound`: the same through IOBinding, each present OrtValue fed back as the next past (no numpy);
- `shared`: one buffer [rows, kv_heads, capacity, head] bound as both past and present (ORT-GenAI's
  share-buffer mode): nothing is copied, the mask is as wide as the longest row plus one.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.graph import Layout, open_session

__all__ = ["MODES", "Layout", "Mode", "SessionRows", "open_session"]

Mode = Literal["run", "bound", "shared"]
MODES: tuple[Mode, ...] = ("run", "bound", "shared")


class SessionRows:
    """Rows decoding together: `join` a prefilled row, `step` them all by one token each, `leave`."""

    def __init__(
        self, session: ort.InferenceSession, layout: Layout, mode: Mode, capacity: int = 256
    ) -> None:
        self.session, self.layout, self.mode = session, layout, mode
        self.lengths: list[int] = []  # tokens in each row's KV
        # run: [rows, heads, width, head] per name; shared: [slots, heads, capacity, head]
        self._past: list[np.ndarray] = []
        self._bound: list[ort.OrtValue] = []  # bound: the last presents
        self._capacity = capacity
        self._binding = session.io_binding()

    def _empty(self, rows: int, width: int) -> np.ndarray:
        return np.zeros((rows, self.layout.kv_heads, width, self.layout.head_size), np.float32)

    def prefill(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One row alone, the whole prompt: its last logits and its KV, [1, heads, len, head] per name."""
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([tokens], np.int64),
            "attention_mask": np.ones((1, len(tokens)), np.int64),
        }
        for name in self.layout.past_names:
            feeds[name] = self._empty(1, 0)
        outputs = self.session.run(["logits", *self.layout.present_names], feeds)
        return outputs[0][0, -1], outputs[1:]

    def _numpy_past(self) -> list[np.ndarray]:
        if self.mode == "bound" and self._bound:
            return [value.numpy() for value in self._bound]
        return self._past

    def join(self, kv: list[np.ndarray], length: int) -> int:
        """Adds a row whose KV ([1, heads, >= length, head] per name) holds `length` tokens; its index."""
        past = self._numpy_past()
        rows = len(self.lengths)
        if self.mode == "shared":
            self._reserve(max([length, *self.lengths]) + 1, rows + 1)
            for buffer, part in zip(self._past, kv, strict=True):
                buffer[rows, :, :length] = part[0, :, :length]
        else:
            width = max([length, *(p.shape[2] for p in past[:1])])
            grown = []
            for index, part in enumerate(kv):
                buffer = self._empty(rows + 1, width)
                if rows:
                    buffer[:rows, :, : past[index].shape[2]] = past[index]
                buffer[rows, :, :length] = part[0, :, :length]
                grown.append(buffer)
            self._past, self._bound = grown, []
        self.lengths.append(length)
        return rows

    def leave(self, row: int) -> None:
        """Removes a row; the last row takes its index (as a slot of a continuous batcher would)."""
        last = len(self.lengths) - 1
        past = self._numpy_past()
        if self.mode == "shared":
            for buffer in past:
                buffer[row] = buffer[last]
        else:
            keep = list(range(last + 1))
            keep[row] = last  # the last row moves into the freed index
            keep = keep[:last]
            self._past = [np.ascontiguousarray(p[keep]) for p in past]
            self._bound = []
        self.lengths[row] = self.lengths[last]
        self.lengths.pop()

    def _reserve(self, width: int, rows: int) -> None:
        slots = self._past[0].shape[0] if self._past else 0
        capacity = self._past[0].shape[2] if self._past else self._capacity
        if self._past and width <= capacity and rows <= slots:
            return
        while capacity < width:
            capacity *= 2
        slots = max(rows, slots)
        grown = []
        for index in range(len(self.layout.past_names)):
            buffer = self._empty(slots, capacity)
            if self._past:
                old = self._past[index]
                buffer[: old.shape[0], :, : old.shape[2]] = old
            grown.append(buffer)
        self._past = grown

    def _mask(self, width: int) -> np.ndarray:
        mask = np.zeros((len(self.lengths), width), np.int64)
        for row, length in enumerate(self.lengths):
            mask[row, : length + 1] = 1
        return mask

    def step(self, tokens: list[int]) -> np.ndarray:
        """One token for each row; the logits [rows, vocab]."""
        rows = len(self.lengths)
        input_ids = np.array(tokens, np.int64).reshape(rows, 1)
        if self.mode == "run":
            width = self._past[0].shape[2] + 1
            feeds = {"input_ids": input_ids, "attention_mask": self._mask(width)}
            feeds.update(zip(self.layout.past_names, self._past, strict=True))
            outputs = self.session.run(["logits", *self.layout.present_names], feeds)
            self._past = outputs[1:]
            logits: np.ndarray = outputs[0][:, -1]
        elif self.mode == "bound":
            logits = self._step_bound(input_ids)
        else:
            logits = self._step_shared(input_ids)
        self.lengths = [length + 1 for length in self.lengths]
        return logits

    def _step_bound(self, input_ids: np.ndarray) -> np.ndarray:
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        past: list[ort.OrtValue] = self._bound or [ort.OrtValue.ortvalue_from_numpy(p) for p in self._past]
        width = past[0].shape()[2] + 1
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", self._mask(width))
        for name, value in zip(self.layout.past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits")
        for name in self.layout.present_names:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self._bound = [outputs[i] for i in range(1, len(outputs))]
        logits: np.ndarray = outputs[0].numpy()[:, -1]
        return logits

    def _step_shared(self, input_ids: np.ndarray) -> np.ndarray:
        rows = len(self.lengths)
        self._reserve(max(self.lengths) + 1, rows)
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", self._mask(max(self.lengths) + 1))
        for past, present, buffer in zip(
            self.layout.past_names, self.layout.present_names, self._past, strict=True
        ):
            value = ort.OrtValue.ortvalue_from_numpy(buffer[:rows])  # the first rows: contiguous
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        logits: np.ndarray = binding.get_outputs()[-1].numpy()[:, -1]
        return logits
