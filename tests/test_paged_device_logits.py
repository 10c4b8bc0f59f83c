"""A run's logits left where the model put them (worker/engines/paged/device_logits.py): the rows the host
reads come back in as few gathers as it asks for, each row once, indexed as the returned rows are."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from worker.engines.device_sampling.runner import SamplerGraph
from worker.engines.paged.device_logits import DeviceLogits

pytestmark = pytest.mark.unit


class Gathers(SamplerGraph):
    def __init__(self) -> None:
        super().__init__(frozenset({0}), 50)
        self.asked: list[list[int]] = []

    def host_rows(self, logits: Any, index: np.ndarray) -> np.ndarray:
        self.asked.append(index.tolist())
        return super().host_rows(logits, index)


def test_the_rows_the_host_reads_come_in_one_gather_and_each_row_once() -> None:
    run = np.random.default_rng(3).standard_normal((12, 50)).astype(np.float16)
    taken = np.array([11, 0, 4, 7, 2, 9])  # the returned rows' tokens, padding rows never named
    sampler = Gathers()
    logits = DeviceLogits(sampler, ort.OrtValue.ortvalue_from_numpy(run), taken)
    assert len(logits) == 6
    logits.fetch([4, 1, 2, 4])
    assert sampler.asked == [[0, 4, 2]]  # the tokens of returned rows 1, 2 and 4, in one gather
    np.testing.assert_array_equal(logits.rows(1, 3), run[[0, 4]].astype(np.float32))
    np.testing.assert_array_equal(logits.row(4), run[2].astype(np.float32))
    assert sampler.asked == [[0, 4, 2]]  # read from what came back
    np.testing.assert_array_equal(logits.rows(3, 6), run[[7, 2, 9]].astype(np.float32))
    assert sampler.asked == [[0, 4, 2], [7, 9]]  # a row not asked for at first: only those missing
    logits.fetch([])
    assert len(sampler.asked) == 2
