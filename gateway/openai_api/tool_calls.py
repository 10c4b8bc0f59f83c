"""A choice's generated text read back as OpenAI's tool calls, whole or as it streams.

The grammar of tools.py decides the answer's shape from its first character: `<` starts calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, separated by newlines), anything else is
text. `CallReader` is fed the text piece by piece and says what is known so far: the text, each call's
name once it is complete, and its arguments as they grow. A call cut short (max_tokens) is never
complete: its streamed pieces end with `finish_reason: "length"`, and a whole answer leaves it out.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.openai_api.tools import CALL_CLOSE, CALL_OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def call_id(_index: int = 0) -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ReadCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class CallPiece:
    """What one piece of text added to a call: `name` the first time it is known, then argument text."""

    index: int
    id: str
    name: str | None
    arguments: str


@dataclass
class CallReader:
    """One choice's output, read as text or calls; `new_id` names the call of each index (chat's ids are
    random, a response's follow from its id, so every reading of its job gives the same)."""

    new_id: Callable[[int], str] = call_id
    text: str = ""  # the answer's text, when it is not calls
    calls: list[ReadCall] = field(default_factory=list)
    _mode: str | None = None  # "text" or "calls", from the first character
    _rest: str = ""  # call text not yet read: from the current call's start

    @property
    def made_calls(self) -> bool:
        return self._mode == "calls"

    def feed(self, piece: str) -> tuple[str, list[CallPiece]]:
        """The text this piece adds, and what it adds to calls."""
        if self._mode is None and piece:
            self._mode = "calls" if piece.startswith("<") else "text"
        if self._mode != "calls":
            self.text += piece
            return piece, []
        self._rest += piece
        return "", self._read()

    def _read(self) -> list[CallPiece]:
        pieces: list[CallPiece] = []
        while True:
            current = self.calls[-1] if self.calls and not self.calls[-1].complete else None
            if current is None:
                rest = self._rest.lstrip("\n")
                if not rest.startswith(CALL_OPEN):
                    return pieces
                head = _HEAD.match(rest, len(CALL_OPEN))
                if head is None:
                    return pieces
                name = json.loads(f'"{head.group(1)}"')
                current = ReadCall(self.new_id(len(self.calls)), name)
                self.calls.append(current)
                self._rest = rest[head.end() :]
                pieces.append(CallPiece(len(self.calls) - 1, current.id, name, ""))
            try:
                _, end = _DECODER.raw_decode(self._rest)
            except json.JSONDecodeError:
                end = None
            if end is None:  # the arguments go on
                added = self._rest[len(current.arguments) :]
                current.arguments = self._rest
                if added:
                    self._add(pieces, current, added)
                return pieces
            added = self._rest[len(current.arguments) : end]
            current.arguments = self._rest[:end]
            if added:
                self._add(pieces, current, added)
            after = self._rest[end:]
            closing = after.lstrip()
            if not closing.startswith("}"):
                return pieces
            tail = closing[1:].lstrip()
            if not tail.startswith(CALL_CLOSE):
                return pieces
            current.complete = True
            self._rest = tail[len(CALL_CLOSE) :]

    def _add(self, pieces: list[CallPiece], call: ReadCall, arguments: str) -> None:
        index = self.calls.index(call)
        if pieces and pieces[-1].index == index:
            pieces[-1].arguments += arguments
        else:
            pieces.append(CallPiece(index, call.id, None, arguments))

    def complete_calls(self) -> list[ReadCall]:
        return [call for call in self.calls if call.complete]


def read_answer(text: str, new_id: Callable[[int], str] = call_id) -> CallReader:
    reader = CallReader(new_id)
    reader.feed(text)
    return reader
