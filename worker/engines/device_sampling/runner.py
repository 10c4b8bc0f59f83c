"""One step's rows through the sampler graph (graph.py): each row's parameters, read from its `RowSampler`,
packed into the graph's arrays, and the graph run in one onnxruntime session.

The logits are read where the model left them: a float32 array [rows, vocab], or an OrtValue of the run's
logits [tokens, vocab] (float16 on a card, float32 on the CPU) with `taken`, the tokens whose rows sample,
gathered and cast at the graph's head. A session is made for each form the first time it runs, or ahead
(`prepare`: the forms of one element type, as the paged engine does when it starts). Rows the host must
pick come back alone (`host_rows`: one gather of just those rows, cast to float32).

A sampled row's uniform is taken from its own generator (`RowSampler.uniform`) before the run; a row the
graph flags `host` keeps it for `RowSampler.choose`, so that the row draws as it would have without the
graph. Rows under a grammar, or with more penalized, counted or biased tokens than the widths, are flagged
before the run and draw nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.sampler import RowSampler
from worker.engines.device_sampling.graph import ELEMENTS, OUTPUTS, sampler_model
from worker.engines.device_sampling.rows import RowGather


@dataclass(frozen=True)
class Widths:
    """The most ids a row may have of each kind; a row with more goes to the host path."""

    penalized: int = 4096  # prompt and generated tokens under the repetition penalty
    counted: int = 1024  # distinct generated tokens under the presence and frequency penalties
    bias: int = 300  # logit_bias entries (OpenAI's limit)


@dataclass(frozen=True)
class SampledStep:
    tokens: np.ndarray  # [rows] int64
    logprobs: np.ndarray  # [rows] float32: the token's log-probability under the unmodified logits
    top_ids: np.ndarray  # [rows, 20] int64, likeliest first
    top_logprobs: np.ndarray  # [rows, 20] float32
    host: np.ndarray  # [rows] bool: rows to pick on the host (`RowSampler.choose`); their outputs are void


class SamplerGraph:
    def __init__(
        self,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        candidates: int = 256,
        widths: Widths = Widths(),
        providers: Sequence[str] = ("CPUExecutionProvider",),
        options: ort.SessionOptions | None = None,
    ) -> None:
        self.candidates = candidates
        self.widths = widths
        self.vocab_size = vocab_size
        self.providers = list(providers)
        self._eos = np.zeros(vocab_size, np.bool_)
        self._eos[[t for t in eos_token_ids if t < vocab_size]] = True
        self._has_eos = bool(self._eos.any())
        self._options = options or ort.SessionOptions()
        # the graph's session for each form of logits (element type, gathered), made at its first run
        self._sessions: dict[tuple[int, bool], ort.InferenceSession] = {}
        self._session: ort.InferenceSession | None = None  # the last one run
        self._rows = RowGather(self.providers, self._options)
        self._fixed: dict[RowSampler, _Fixed] = {}  # by row (pack)
        # the last step's rows, their _Fixed, columns and visited rows (_columns_of)
        self._last: tuple[list[RowSampler], list[_Fixed], dict[str, np.ndarray], list[int]] | None = None

    def end_profiling(self) -> str:
        """The file of the last run session's profile, when its options asked for one (enable_profiling)."""
        if self._session is None:
            raise RuntimeError("the sampler graph has not run yet: no session has a profile")
        return str(self._session.end_profiling())

    def run(
        self,
        logits: np.ndarray | ort.OrtValue,
        samplers: Sequence[RowSampler],
        produced: Sequence[int],
        taken: np.ndarray | None = None,
    ) -> SampledStep:
        """The next token of each row from the step's logits (not modified): [rows, vocab], an array or an
        OrtValue; or with `taken`, the run's [tokens, vocab] as an OrtValue where the model left them (on
        the card, read there without a copy) and the token of each row. `produced`: the tokens each row has
        generated (for min_tokens)."""
        return self.run_packed(self.pack(samplers, produced), logits, taken)

    def run_packed(
        self, feeds: dict[str, np.ndarray], logits: np.ndarray | ort.OrtValue, taken: np.ndarray | None = None
    ) -> SampledStep:
        """The graph on inputs `pack` made and the step's logits; only the outputs come back to the host."""
        rows = logits.shape[0] if isinstance(logits, np.ndarray) else logits.shape()[0]
        if taken is not None and len(taken) == rows and np.array_equal(taken, np.arange(rows)):
            taken = None  # every row, in order: the logits are the rows' already (no gather, no copy)
        gathered = taken is not None
        if isinstance(logits, np.ndarray):
            if logits.dtype != np.float16:
                logits = np.ascontiguousarray(logits, np.float32)
            session = self._session_for(ELEMENTS[str(logits.dtype)], gathered)
            if taken is not None:
                feeds = {**feeds, "taken": np.asarray(taken, np.int64)}
            outputs = session.run(None, {**feeds, "logits": logits})
        else:
            session = self._session_for(ELEMENTS[logits.data_type()], gathered)
            binding = session.io_binding()
            binding.bind_ortvalue_input("logits", logits)
            if taken is not None:
                binding.bind_cpu_input("taken", np.asarray(taken, np.int64))
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            for name, _, _ in OUTPUTS:
                binding.bind_output(name, "cpu")
            session.run_with_iobinding(binding)
            outputs = binding.copy_outputs_to_cpu()
        tokens, logprobs, top_ids, top_logprobs, host = outputs
        return SampledStep(tokens, logprobs, top_ids, top_logprobs, host)

    def host_rows(self, logits: ort.OrtValue, index: np.ndarray) -> np.ndarray:
        """Rows `index` of a run's logits [tokens, vocab], where the model left them, on the host as float32
        [rows, vocab]: one gather and cast on the graph's provider, only those rows copied."""
        return self._rows.take(logits, index)

    def prepare(self, element: str) -> None:
        """Makes the graph's sessions for logits of `element` (onnxruntime's or numpy's name of their type)
        in both forms, the rows' and a run's with `taken`, ahead of the first step that reads them."""
        for gathered in (False, True):
            self._made(ELEMENTS[element], gathered)

    def _session_for(self, element: int, gathered: bool) -> ort.InferenceSession:
        self._session = self._made(element, gathered)
        return self._session

    def _made(self, element: int, gathered: bool) -> ort.InferenceSession:
        session = self._sessions.get((element, gathered))
        if session is None:
            model = sampler_model(self.vocab_size, self.candidates, element, gathered).SerializeToString()
            session = ort.InferenceSession(model, self._options, providers=self.providers)
            self._sessions[element, gathered] = session
        return session

    def pack(self, samplers: Sequence[RowSampler], produced: Sequence[int]) -> dict[str, np.ndarray]:
        """The graph's inputs but the logits: each row's parameters, and its uniform if it samples. What a
        row's request fixes is read once per row (`_Fixed`) and packed column by column; only the rows that
        sample, or have penalized, counted or biased ids, are visited one by one."""
        count = len(samplers)
        fixed, columns, visited = self._columns_of(samplers)
        host = columns["host_in"].copy()
        penalized: list[tuple[int, np.ndarray]] = []
        counted: list[tuple[int, np.ndarray]] = []
        counts: list[tuple[int, np.ndarray]] = []
        bias_ids: list[tuple[int, np.ndarray]] = []
        bias: list[tuple[int, np.ndarray]] = []
        uniform = np.zeros(count, np.float32)
        widths = self.widths
        for index in visited:
            sampler, row = samplers[index], fixed[index]
            if row.host:
                continue
            if len(sampler.penalized) > widths.penalized or len(sampler.counts) > widths.counted:
                host[index] = True
                continue
            if row.greedy is False:
                uniform[index] = np.float32(sampler.uniform())
            if sampler.penalized:
                penalized.append((index, np.fromiter(sampler.penalized, np.int64)))
            if sampler.counts:
                counted.append((index, np.fromiter(sampler.counts, np.int64)))
                counts.append((index, np.fromiter(sampler.counts.values(), np.float32)))
            ids, values = sampler.bias
            if ids.size:
                bias_ids.append((index, ids))
                bias.append((index, values))
        # RowSampler.masks_eos for every row: fewer tokens than min_tokens, and an end of sequence to mask
        mask_eos = (np.array(produced, np.int64).reshape(count) < columns["least"]) & self._has_eos
        return {
            "eos": self._eos,
            "greedy": columns["greedy"],
            "temperature": columns["temperature"],
            "top_k": columns["top_k"],
            "top_p": columns["top_p"],
            "uniform": uniform,
            "repetition_penalty": columns["repetition_penalty"],
            "penalized": _padded(count, penalized),
            "presence_penalty": columns["presence_penalty"],
            "frequency_penalty": columns["frequency_penalty"],
            "counted": _padded(count, counted),
            "counts": _padded(count, counts, np.float32),
            "bias_ids": _padded(count, bias_ids),
            "bias": _padded(count, bias, np.float32),
            "mask_eos": mask_eos,
            "host_in": host,
        }

    def _columns_of(
        self, samplers: Sequence[RowSampler]
    ) -> tuple[list[_Fixed], dict[str, np.ndarray], list[int]]:
        """The rows' `_Fixed`, their columns as the graph takes them, and the rows visited one by one; kept
        while the rows are the same ones in the same order (a step of decodes after another)."""
        last = self._last
        if last is not None and len(last[0]) == len(samplers) and all(map(operator.is_, last[0], samplers)):
            return last[1], last[2], last[3]
        count = len(samplers)
        fixed = self._fixed_of(samplers)
        rows = list(zip(*fixed, strict=True)) if fixed else [()] * len(_Fixed._fields)
        columns: dict[str, np.ndarray] = {
            name: np.array(values, dtype).reshape(count)
            for name, values, dtype in zip(_COLUMNS, rows, _DTYPES, strict=True)
        }
        visited = [i for i, row in enumerate(fixed) if row.visited]
        self._last = (list(samplers), fixed, columns, visited)
        return fixed, columns, visited

    def _fixed_of(self, samplers: Sequence[RowSampler]) -> list[_Fixed]:
        """Each row's `_Fixed`, made at its first step; forgotten once its row has left (the cache holds at
        most twice the rows of a step)."""
        known = self._fixed
        if len(known) > 2 * len(samplers) + 64:
            known = self._fixed = {sampler: known[sampler] for sampler in samplers if sampler in known}
        fixed = []
        for sampler in samplers:
            row = known.get(sampler)
            if row is None:
                row = known[sampler] = self._fixed_row(sampler)
            fixed.append(row)
        return fixed

    def _fixed_row(self, sampler: RowSampler) -> _Fixed:
        request, widths = sampler.request, self.widths
        bias_ids = sampler.bias[0]
        host = (
            request.guidance is not None
            or bias_ids.size > widths.bias
            or np.unique(bias_ids).size != bias_ids.size  # numpy's `+=` keeps one of a repeated id's biases
        )
        # its penalized and counted ids change as it generates, and a sampled pick draws a uniform
        varies = request.repetition_penalty != 1.0 or bool(
            request.presence_penalty or request.frequency_penalty
        )
        return _Fixed(
            host,
            host
            or varies
            or sampler.sampling
            or bool(bias_ids.size)
            or bool(sampler.penalized or sampler.counts),
            not sampler.sampling,
            1.0 if not sampler.sampling else request.temperature,
            sampler.top_k,
            request.top_p,
            request.repetition_penalty,
            request.presence_penalty,
            request.frequency_penalty,
            request.min_new_tokens,
        )


class _Fixed(NamedTuple):
    """What a row's request fixes for the whole of its generation, as the graph's columns take it."""

    host: bool  # a grammar, or a logit_bias the graph cannot apply: RowSampler picks every token
    visited: bool  # packed one by one at each step: it samples, or has (or may have) ids of its own
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_new_tokens: int


# _Fixed's fields as the graph's columns: their input names (host's is host_in's start; visited and
# min_new_tokens, "least", are the host's own) and types.
_COLUMNS = (
    "host_in",
    "visited",
    "greedy",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "least",
)
_DTYPES = (
    np.bool_,
    np.bool_,
    np.bool_,
    np.float32,
    np.int64,
    np.float64,
    np.float32,
    np.float32,
    np.float32,
    np.int64,
)


def _padded(count: int, rows: list[tuple[int, np.ndarray]], dtype: type = np.int64) -> np.ndarray:
    """[count, widest] of the rows' arrays at their indexes, padded with -1 (ids) or 0 (values); a row with
    none (not listed) all padding."""
    width = max((row.size for _, row in rows), default=0) or 1
    padded: np.ndarray = np.full((count, width), -1 if dtype is np.int64 else 0, dtype)
    for index, row in rows:
        padded[index, : row.size] = row
    return padded
