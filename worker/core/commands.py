"""What a frontend tells the engine core: submit a request, cancel a row, stop.

A submit crosses once per request: its prompt as int32 bytes (a long prompt stays cheap, and the engine
core packs arrays anyway) and the rest of its `GenerationRequest` pickled. Pickle rather than JSON: the
request is a frozen dataclass of tuples and optional fields that pickle restores exactly without a
converter, and the peer is the worker's own child on a private socketpair, the same build and trusted.
Cancel and stop are a tag and a struct.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from worker.engine import GenerationRequest

_SUBMIT = b"S"
_CANCEL = b"C"
_STOP = b"X"
_SUBMIT_HEAD = struct.Struct("<iI")  # row id, prompt tokens
_ROW = struct.Struct("<i")


@dataclass(frozen=True, slots=True)
class Submit:
    row_id: int  # chosen by the frontend, unique among its rows; the engine core's steps name it
    prompt: NDArray[np.int32]
    request: GenerationRequest  # its prompt_ids are empty on the engine core's side: see prompt

    @classmethod
    def of(cls, row_id: int, request: GenerationRequest) -> Submit:
        return cls(row_id, np.asarray(request.prompt_ids, dtype=np.int32), request)

    def request_with_prompt(self) -> GenerationRequest:
        """The request as the frontend made it, its prompt back in place."""
        return replace(self.request, prompt_ids=self.prompt.tolist())


@dataclass(frozen=True, slots=True)
class Cancel:
    row_id: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Submit | Cancel | Stop


class CommandDecodeError(ValueError):
    def __init__(self, tag: bytes, size: int) -> None:
        super().__init__(f"malformed command {tag!r} ({size} bytes)")
        self.tag = tag
        self.size = size


def encode_command(command: Command) -> bytes:
    if isinstance(command, Submit):
        prompt = np.ascontiguousarray(command.prompt, dtype=np.int32)
        rest = pickle.dumps(replace(command.request, prompt_ids=[]), protocol=pickle.HIGHEST_PROTOCOL)
        return b"".join((_SUBMIT, _SUBMIT_HEAD.pack(command.row_id, len(prompt)), prompt.tobytes(), rest))
    if isinstance(command, Cancel):
        return _CANCEL + _ROW.pack(command.row_id)
    return _STOP


def decode_command(payload: bytes | memoryview) -> Command:
    tag = bytes(payload[:1])
    size = len(payload)
    if tag == _SUBMIT and size >= 1 + _SUBMIT_HEAD.size:
        row_id, length = _SUBMIT_HEAD.unpack_from(payload, 1)
        start = 1 + _SUBMIT_HEAD.size
        if size >= start + 4 * length:
            prompt = np.frombuffer(payload, dtype=np.int32, count=length, offset=start)
            request = pickle.loads(payload[start + 4 * length :])
            if isinstance(request, GenerationRequest):
                return Submit(row_id, prompt, request)
    elif tag == _CANCEL and size == 1 + _ROW.size:
        return Cancel(_ROW.unpack_from(payload, 1)[0])
    elif tag == _STOP and size == 1:
        return Stop()
    raise CommandDecodeError(tag, size)
