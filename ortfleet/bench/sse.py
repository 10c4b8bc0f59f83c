"""Server-sent events from the bytes of a response body, each stamped with the time its bytes arrived.

Benchmarks share their cores with the fleet they measure, so this is the least the format asks for
(WHATWG's event-stream: lines end in LF, CRLF or CR; a blank line ends an event; `data:` lines join with
LF; a comment or an empty frame is no event) on whole chunks, without a general-purpose SSE library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SseEvent:
    id: str
    event: str
    data: str
    received: float  # time.perf_counter() when its last bytes arrived


class SseDecoder:
    """Feed it a response body's chunks as they arrive; it returns the events each completes."""

    def __init__(self) -> None:
        self._pending = b""  # the start of an event whose blank line has not arrived yet

    def feed(self, chunk: bytes, received: float) -> list[SseEvent]:
        buffer = self._pending + chunk
        held = b""
        if b"\r" in buffer:  # CRLF or CR line ends: made LF, but a CR at the end may be a CRLF's half
            if buffer.endswith(b"\r"):
                buffer, held = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n\n" not in buffer:
            self._pending = buffer + held
            return []
        *frames, rest = buffer.split(b"\n\n")
        self._pending = rest + held
        events = []
        for frame in frames:
            event = parse_frame(frame, received)
            if event is not None:
                events.append(event)
        return events


def parse_frame(frame: bytes, received: float) -> SseEvent | None:
    """One event from the lines between two blank lines (LF line ends); None for a comment only (a
    keep-alive) or nothing."""
    entry_id = kind = ""
    data: list[str] = []
    for line in frame.decode().split("\n"):
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "id":
            entry_id = value
        elif name == "event":
            kind = value
    if not data and not kind:
        return None
    return SseEvent(entry_id, kind or "message", "\n".join(data), received)
