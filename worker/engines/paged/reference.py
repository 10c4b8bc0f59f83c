"""The paged model's contract (model.py) computed in numpy, on the host: a small causal transformer with
random weights whose keys and values live in a pool of blocks, read and written through each row's block
table exactly as the paged operator does on the card.

It is what the scheduler is tested against without a card: in float64 a row's tokens do not depend on
which rows share its runs, on how its prompt is chunked or on which blocks it holds, so any difference
between a row run alone and in a batch is the scheduler's or the block tables' doing. It is no stand-in
for the model's speed or its fp16 numerics.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engines.paged.model import PackedRow, pack


class ReferencePagedModel:
    def __init__(
        self, blocks: int, block_size: int, vocab: int = 97, width: int = 16, layers: int = 2, seed: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.blocks = blocks
        self.block_size = block_size
        self.vocab = vocab
        self._embed = rng.standard_normal((vocab, width))
        self._layers = [
            tuple(rng.standard_normal((width, width)) / np.sqrt(width) for _ in range(4))
            for _ in range(layers)
        ]  # query, key, value, output
        self._head = rng.standard_normal((width, vocab))
        self._angles = rng.uniform(0.01, 1.0, width)  # positions enter every key and query
        # keys and values of every layer: [layers, 2, blocks * block_size, width]; NaN where never written
        self.pool = np.full((layers, 2, blocks * block_size, width), np.nan)
        self.runs = 0

    def returned_logits(self, rows: Sequence[PackedRow]) -> np.ndarray:
        """Each row's last token's logits, each of its tokens' for a row with all_logits ([taken, vocab],
        as model.py's run), its new tokens' keys and values written to its blocks; the runs' inputs checked
        as the model's (pack)."""
        pack(rows, self.block_size)
        self.runs += 1
        return np.concatenate([self._row(row)[-row.returned :] for row in rows])

    def _slot(self, row: PackedRow, position: int) -> int:
        return int(row.table[position // self.block_size]) * self.block_size + position % self.block_size

    def _row(self, row: PackedRow) -> np.ndarray:
        """The logits of each of the row's new tokens [tokens, vocab]."""
        out = []
        for offset, token in enumerate(row.tokens):
            position = row.past + offset
            hidden = self._embed[token] + np.sin(self._angles * position)
            for layer, (query, key, value, output) in enumerate(self._layers):
                slot = self._slot(row, position)
                self.pool[layer, 0, slot] = hidden @ key
                self.pool[layer, 1, slot] = hidden @ value
                slots = [self._slot(row, p) for p in range(position + 1)]
                keys, values = self.pool[layer, 0, slots], self.pool[layer, 1, slots]
                if np.isnan(keys).any():
                    raise ValueError(f"position {position} attends to a slot never written")
                scores = keys @ (hidden @ query)
                weights = np.exp(scores - scores.max())
                hidden = hidden + (weights / weights.sum()) @ values @ output
            out.append(hidden @ self._head)
        return np.stack(out)
