"""A run's logits left where the model put them, for the paged engine's sampler graph (engine.py): the
runner's side (`DeviceRunner.run`: model.py on a card, cpu_model.py on the CPU) and the step's side
(`DeviceLogits`: the graph reads them there; the rows the host reads come back in one gather)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from worker.engines.device_sampling.runner import SamplerGraph
from worker.engines.paged.model import PackedRow

if TYPE_CHECKING:
    import onnxruntime as ort


@runtime_checkable
class DeviceRunner(Protocol):
    def run(self, rows: Sequence[PackedRow]) -> tuple[ort.OrtValue, np.ndarray]:
        """One run of `rows`: the logits of its tokens where the model left them (an OrtValue [tokens,
        vocab]), and `taken`, the indexes of the tokens whose logits `returned_logits` would return."""
        ...


class DeviceLogits:
    """A run's returned logits left where the model put them (`DeviceRunner.run`): the sampler graph reads
    them there (`logits`, `taken`), and the rows the host reads come to it in one gather (`fetch`), indexed
    as `returned_logits`' rows are."""

    def __init__(self, sampler: SamplerGraph, logits: ort.OrtValue, taken: np.ndarray) -> None:
        self.logits = logits
        self.taken = taken
        self._sampler = sampler
        self._at: dict[int, int] = {}  # a fetched row's index among the returned rows: its row in _rows
        self._rows = np.empty((0, 0), np.float32)

    def __len__(self) -> int:
        return len(self.taken)

    def fetch(self, wanted: Iterable[int]) -> None:
        """Brings the returned rows `wanted` that are not on the host yet to it, in one gather."""
        at = self._at
        index = sorted({row for row in wanted if row not in at})
        if not index:
            return
        rows = self._sampler.host_rows(self.logits, self.taken[index])
        at.update((row, len(self._rows) + position) for position, row in enumerate(index))
        self._rows = np.concatenate([self._rows, rows]) if len(self._rows) else rows

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Returned rows [start, stop) on the host (fetched already, else fetched now)."""
        self.fetch(range(start, stop))
        at = self._at
        first = at[start]
        if all(at[row] == first + row - start for row in range(start, stop)):
            return self._rows[first : first + stop - start]
        return self._rows[[at[row] for row in range(start, stop)]]

    def row(self, index: int) -> np.ndarray:
        row: np.ndarray = self.rows(index, index + 1)[0]
        return row
