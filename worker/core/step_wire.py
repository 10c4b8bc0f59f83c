"""One engine step's output for one frontend, as arrays, and its encoding as one bytes buffer.

Layout (little-endian): a 40-byte header (`HEADER`), then the arrays back to back: row ids (int32, n),
token offsets (int32, n + 1: row i's tokens are tokens[offsets[i]:offsets[i + 1]], as an `EngineUpdate`
carries a list of tokens), tokens (int32), then, when the step carries log-probabilities, the positions in
tokens they belong to (int32, m, ascending), the chosen tokens' logprobs (float64, m), the top ids (int32,
m x k, -1 past a row's own count) and their logprobs (float64, m x k); then the finish codes (int8, n: 0
running, else `FINISH_CODES`); then the notes (UTF-8 JSON, rare fields of an entry such as an error's
message, by the entry's index). The version byte fixes the dtypes. Log-probabilities cross as float64, as
the CPU batcher computes them, so a frontend answers what the engine in its own process would, to the
last digit.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray

from worker.engine import Finish

VERSION = 2
HEADER = struct.Struct(
    "<BBHIIIIIQQ"
)  # version, flags, top k, rows, tokens, logprobs, notes, running, step, ns
_LOGPROBS = 1  # flag: the step carries a logprob block

# 0 is a row still running; the others follow Finish's order, so a new Finish appends a code.
FINISH_CODES: dict[Finish, int] = {finish: code for code, finish in enumerate(Finish, start=1)}
FINISHES: tuple[Finish | None, ...] = (None, *Finish)

Int32s = NDArray[np.int32]
Float64s = NDArray[np.float64]


class StepDecodeError(ValueError):
    def __init__(self, reason: str, size: int) -> None:
        super().__init__(f"malformed step ({size} bytes): {reason}")
        self.reason = reason
        self.size = size


@dataclass(frozen=True, slots=True)
class LogprobBlock:
    """The log-probabilities of the tokens whose rows asked for them."""

    positions: Int32s  # indexes into Step.tokens, ascending
    logprobs: Float64s  # the chosen token's
    top_ids: Int32s  # [m, k], likeliest first, -1 past the row's own count
    top_logprobs: Float64s  # [m, k]


@dataclass(frozen=True, slots=True)
class Step:
    step: int
    running: int  # rows the engine core runs for every frontend at this step
    row_ids: Int32s
    offsets: Int32s
    tokens: Int32s
    finish: NDArray[np.int8]
    logprobs: LogprobBlock | None = None
    notes: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # entry index -> rare fields
    sent_ns: int = 0  # time.monotonic_ns() as encode_step finished (0 before)

    @classmethod
    def one_token_each(
        cls,
        step: int,
        running: int,
        row_ids: Int32s,
        tokens: Int32s,
        finish: NDArray[np.int8],
        logprobs: LogprobBlock | None = None,
    ) -> Step:
        offsets = np.arange(len(row_ids) + 1, dtype=np.int32)
        return cls(step, running, row_ids, offsets, tokens, finish, logprobs)

    def row_tokens(self, index: int) -> Int32s:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def row_finish(self, index: int) -> Finish | None:
        return FINISHES[int(self.finish[index])]


def _array(values: NDArray[Any], dtype: type[np.generic], count: int, name: str) -> NDArray[Any]:
    array = np.ascontiguousarray(values, dtype=dtype)
    if array.size != count:
        raise ValueError(f"{name} holds {array.size} values, not {count}")
    return array


def encode_step(step: Step) -> bytes:
    rows = len(step.row_ids)
    tokens = len(step.tokens)
    parts: list[Any] = [
        b"",  # the header, packed last so that its time is the send's
        _array(step.row_ids, np.int32, rows, "row_ids"),
        _array(step.offsets, np.int32, rows + 1, "offsets"),
        _array(step.tokens, np.int32, tokens, "tokens"),
    ]
    flags = top_k = entries = 0
    block = step.logprobs
    if block is not None:
        flags |= _LOGPROBS
        entries = len(block.positions)
        top_k = block.top_ids.shape[1] if block.top_ids.ndim == 2 else 0
        parts += [
            _array(block.positions, np.int32, entries, "positions"),
            _array(block.logprobs, np.float64, entries, "logprobs"),
            _array(block.top_ids, np.int32, entries * top_k, "top_ids"),
            _array(block.top_logprobs, np.float64, entries * top_k, "top_logprobs"),
        ]
    parts.append(_array(step.finish, np.int8, rows, "finish"))
    notes = orjson.dumps(step.notes, option=orjson.OPT_NON_STR_KEYS) if step.notes else b""
    parts.append(notes)
    parts[0] = HEADER.pack(
        VERSION, flags, top_k, rows, tokens, entries, len(notes), step.running, step.step, time.monotonic_ns()
    )
    return b"".join(parts)


def decode_step(payload: bytes | memoryview) -> Step:
    """The step in `payload`, its arrays read-only views into it (no copy, no object per row)."""
    size = len(payload)
    if size < HEADER.size:
        raise StepDecodeError("shorter than the header", size)
    version, flags, top_k, rows, tokens, entries, notes, running, number, sent_ns = HEADER.unpack_from(
        payload
    )
    if version != VERSION:
        raise StepDecodeError(f"version {version}, not {VERSION}", size)
    logprob_bytes = 12 * entries * (1 + top_k) if flags & _LOGPROBS else 0  # an int32 and a float64 each
    if size != HEADER.size + 4 * (2 * rows + 1 + tokens) + logprob_bytes + rows + notes:
        raise StepDecodeError("its length does not match its counts", size)
    offset = HEADER.size

    def take(dtype: type[np.generic], count: int) -> NDArray[Any]:
        nonlocal offset
        array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
        offset += array.nbytes
        return array

    row_ids = take(np.int32, rows)
    offsets = take(np.int32, rows + 1)
    token_ids = take(np.int32, tokens)
    block = None
    if flags & _LOGPROBS:
        block = LogprobBlock(
            take(np.int32, entries),
            take(np.float64, entries),
            take(np.int32, entries * top_k).reshape(entries, top_k),
            take(np.float64, entries * top_k).reshape(entries, top_k),
        )
    finish = take(np.int8, rows)
    note_map: dict[int, Any] = {}
    if notes:
        note_map = {
            int(entry): fields for entry, fields in orjson.loads(payload[offset : offset + notes]).items()
        }
    return Step(number, running, row_ids, offsets, token_ids, finish, block, note_map, sent_ns)
