"""One step's rows through the sampler graph (graph.py): each row's parameters, read from its `RowSampler`,
packed into the graph's arrays, and the graph run in one onnxruntime session.

A sampled row's uniform is taken from its own generator (`RowSampler.uniform`) before the run; a row the
graph flags `host` keeps it for `RowSampler.choose`, so that the row draws as it would have without the
graph. Rows under a grammar, or with more penalized, counted or biased tokens than the widths, are flagged
before the run and draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.sampler import RowSampler
from worker.engines.device_sampling.graph import OUTPUTS, sampler_model


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
        self._eos = np.zeros(vocab_size, np.bool_)
        self._eos[[t for t in eos_token_ids if t < vocab_size]] = True
        options = options or ort.SessionOptions()
        model = sampler_model(candidates).SerializeToString()
        self._session = ort.InferenceSession(model, options, providers=list(providers))

    def end_profiling(self) -> str:
        """The file of the session's profile, when its options asked for one (enable_profiling)."""
        return str(self._session.end_profiling())

    def run(
        self, logits: np.ndarray | ort.OrtValue, samplers: Sequence[RowSampler], produced: Sequence[int]
    ) -> SampledStep:
        """The next token of each row from the step's logits [rows, vocab] (float32, not modified): an
        array, or an OrtValue where the model left them (on the card, read there without a copy);
        `produced`: the tokens each row has generated (for min_tokens)."""
        return self.run_packed(self.pack(samplers, produced), logits)

    def run_packed(self, feeds: dict[str, np.ndarray], logits: np.ndarray | ort.OrtValue) -> SampledStep:
        """The graph on inputs `pack` made and the step's logits; only the outputs come back to the host."""
        if isinstance(logits, np.ndarray):
            outputs = self._session.run(None, {**feeds, "logits": np.ascontiguousarray(logits, np.float32)})
        else:
            binding = self._session.io_binding()
            binding.bind_ortvalue_input("logits", logits)
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            for name, _, _ in OUTPUTS:
                binding.bind_output(name, "cpu")
            self._session.run_with_iobinding(binding)
            outputs = binding.copy_outputs_to_cpu()
        tokens, logprobs, top_ids, top_logprobs, host = outputs
        return SampledStep(tokens, logprobs, top_ids, top_logprobs, host)

    def pack(self, samplers: Sequence[RowSampler], produced: Sequence[int]) -> dict[str, np.ndarray]:
        """The graph's inputs but the logits: each row's parameters, and its uniform if it samples."""
        count = len(samplers)
        host = np.zeros(count, np.bool_)
        for index, sampler in enumerate(samplers):
            host[index] = self._unservable(sampler)
        served = [s for s, h in zip(samplers, host, strict=True) if not h]
        penalized = _padded([np.fromiter(s.penalized, np.int64) for s in served], host)
        counted = _padded([np.fromiter(s.counts, np.int64) for s in served], host)
        counts = _padded([np.fromiter(s.counts.values(), np.float32) for s in served], host, np.float32)
        bias_ids = _padded([s.bias[0] for s in served], host)
        bias = _padded([s.bias[1] for s in served], host, np.float32)
        requests = [s.request for s in samplers]
        greedy = np.array([not s.sampling for s in samplers], np.bool_)
        uniform = np.zeros(count, np.float32)
        for index, sampler in enumerate(samplers):
            if sampler.sampling and not host[index]:
                uniform[index] = np.float32(sampler.uniform())
        return {
            "eos": self._eos,
            "greedy": greedy,
            "temperature": np.array(
                [1.0 if g else r.temperature for r, g in zip(requests, greedy, strict=True)], np.float32
            ),
            "top_k": np.array([s.top_k for s in samplers], np.int64),
            "top_p": np.array([r.top_p for r in requests], np.float64),
            "uniform": uniform,
            "repetition_penalty": np.array([r.repetition_penalty for r in requests], np.float32),
            "penalized": penalized,
            "presence_penalty": np.array([r.presence_penalty for r in requests], np.float32),
            "frequency_penalty": np.array([r.frequency_penalty for r in requests], np.float32),
            "counted": counted,
            "counts": counts,
            "bias_ids": bias_ids,
            "bias": bias,
            "mask_eos": np.array([s.masks_eos(p) for s, p in zip(samplers, produced, strict=True)], np.bool_),
            "host_in": host,
        }

    def _unservable(self, sampler: RowSampler) -> bool:
        widths = self.widths
        bias_ids = sampler.bias[0]
        return (
            sampler.request.guidance is not None
            or len(sampler.penalized) > widths.penalized
            or len(sampler.counts) > widths.counted
            or bias_ids.size > widths.bias
            or np.unique(bias_ids).size != bias_ids.size  # numpy's `+=` keeps one of a repeated id's biases
        )


def _padded(rows: list[np.ndarray], host: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """The served rows' arrays at their places, padded with -1 (ids) or 0 (values) to the widest."""
    width = max((row.size for row in rows), default=0) or 1
    padded: np.ndarray = np.full((host.size, width), -1 if dtype is np.int64 else 0, dtype)
    served = iter(rows)
    for index, flagged in enumerate(host):
        if not flagged:
            row = next(served)
            padded[index, : row.size] = row
    return padded
