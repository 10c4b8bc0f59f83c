"""The paged model's contract (model.py) on the CPU, over the model folder's GroupQueryAttention graph (the
one ortfleet's batcher runs, worker/engines/batcher/graph.py): the keys and values live in a pool of blocks
[blocks, block_size, kv_heads, head], and each run gathers its rows' past from their blocks into a
right-padded buffer, runs the graph on it, and writes the new positions back to their blocks.

The graph takes one sequence length per run and, with a past, one row per prompt chunk: the decoding rows
of a run share one run of the graph, each prompt chunk runs alone, as in the batcher. So a request's tokens
here are the batcher's, which makes this the scheduler's reference on real models without a card. A chunk
run alone has every position's logits: a row that asks for all its logits (`PackedRow.all_logits`) gets
them, the batcher's prompt logits. The gathers cost a copy of each row's past per run: it is a
reference, not the CPU engine.

LoRA adapters (`PackedRow.adapter`) are the batcher's too: the graph rewritten for them (lora_graph.py) and
each run's rows scaled into their adapters' columns (lora.py's Columns.row_scale), so the decoding rows of
different adapters and of the base model share their run.

`run` gives what model.py's `run` gives, the run's logits as an OrtValue with the indexes of the rows
taken, so that the paged engine's sampler graph reads them as it does on a card: here the logits are
already the taken rows (float32 [taken, vocab], on the CPU), and `taken` counts them in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.graph import Layout, open_session, positions
from worker.engines.batcher.lora_graph import ROW_SCALE
from worker.engines.paged.model import PackedRow, by_row, pack

if TYPE_CHECKING:
    from worker.engines.batcher.adapter_library import AdapterLibrary
    from worker.engines.batcher.lora import AdapterSet


class CpuPagedModel:
    def __init__(
        self,
        model_dir: Path,
        blocks: int,
        block_size: int,
        threads: int = 0,
        adapters: AdapterLibrary | None = None,
    ) -> None:
        graph = None if adapters is None else adapters.rewritten()
        self.session, self.layout = open_session(model_dir, threads, graph)
        self.adapters: AdapterSet | None = None if adapters is None else adapters.layouts()
        self.blocks = blocks
        self.block_size = block_size
        self.vocab = self.layout.vocab_size
        shape = (blocks * block_size, self.layout.kv_heads, self.layout.head_size)  # one slot a position
        self.pool = [np.zeros(shape, np.float32) for _ in self.layout.past_names]

    def returned_logits(self, rows: Sequence[PackedRow]) -> np.ndarray:
        """What model.py's run returns: each row's last token's logits, each of its tokens' for a row with
        all_logits, float32 [taken, vocab]."""
        taken = pack(rows, self.block_size)["taken"]  # the same checks as on the card
        out = np.empty((len(taken), self.vocab), np.float32)
        parts = by_row(rows, out)  # views of `out`, one a row
        decoding: list[int] = []  # one run for all of them
        alone: list[int] = []  # prompt chunks: each runs by itself
        for index, row in enumerate(rows):
            (decoding if len(row.tokens) == 1 and row.past > 0 else alone).append(index)
        if decoding:
            logits = self._run([rows[index] for index in decoding])
            for index, row_logits in zip(decoding, logits, strict=True):
                parts[index][:] = row_logits  # one token: its last is all of its logits
        for index in alone:
            row = rows[index]
            parts[index][:] = self._run([row])[0][-row.returned :]
        return out

    def run(self, rows: Sequence[PackedRow]) -> tuple[ort.OrtValue, np.ndarray]:
        """What model.py's run returns: the run's logits where they lie, as an OrtValue (here the returned
        rows, `returned_logits`), and the indexes of the returned rows among them (here all, in order)."""
        logits = self.returned_logits(rows)
        return ort.OrtValue.ortvalue_from_numpy(logits), np.arange(len(logits), dtype=np.int64)

    def use_adapters(
        self, session: tuple[ort.InferenceSession, Layout] | None, adapters: AdapterSet | None
    ) -> None:
        """From the next run on: these adapters' layouts, and `session` where the graph gained projections
        (an adapter loaded at run time). The pool stays."""
        if session is not None:
            self.session, self.layout = session
        self.adapters = adapters

    def _slots(self, row: PackedRow, start: int, stop: int) -> np.ndarray:
        """The pool's slots of the row's positions [start, stop)."""
        position = np.arange(start, stop)
        table = np.asarray(row.table, np.int64)
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _run(self, rows: Sequence[PackedRow]) -> np.ndarray:
        """One run of the graph on rows that bring as many tokens each; every position's logits [rows,
        tokens, vocab]."""
        new = len(rows[0].tokens)
        width = max(row.past for row in rows) + new
        layout = self.layout
        buffers = [
            np.zeros((len(rows), layout.kv_heads, width, layout.head_size), np.float32) for _ in self.pool
        ]
        mask = np.zeros((len(rows), width), np.int64)
        for index, row in enumerate(rows):
            past = self._slots(row, 0, row.past)
            for buffer, pool in zip(buffers, self.pool, strict=True):
                buffer[index, :, : row.past] = pool[past].transpose(1, 0, 2)
            mask[index, : row.past + new] = 1
        binding = self.session.io_binding()
        for past_name, present_name, buffer in zip(
            layout.past_names, layout.present_names, buffers, strict=True
        ):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(past_name, value)
            binding.bind_ortvalue_output(present_name, value)  # written in place at each row's length
        binding.bind_cpu_input("input_ids", np.asarray([list(row.tokens) for row in rows], np.int64))
        binding.bind_cpu_input("attention_mask", mask)
        if self.adapters is not None:
            adapters = [row.adapter for row in rows]
            columns = self.adapters.layout(adapters)
            columns.bind(binding)
            binding.bind_cpu_input(ROW_SCALE, columns.row_scale(adapters))
        if layout.position_ids is not None:
            binding.bind_cpu_input(layout.position_ids, positions(mask, new))
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        logits: np.ndarray = binding.get_outputs()[-1].numpy()
        for index, row in enumerate(rows):
            written = self._slots(row, row.past, row.past + new)
            for buffer, pool in zip(buffers, self.pool, strict=True):
                pool[written] = buffer[index, :, row.past : row.past + new].transpose(1, 0, 2)
        return logits
