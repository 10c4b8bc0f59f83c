"""A small HTTP/1.1 client on asyncio streams: JSON requests and SSE on keep-alive connections.

Benchmarks share two cores with the fleet they measure, so the client must cost little per event:
this one parses chunked transfer encoding and SSE frames without a general-purpose HTTP stack.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ortfleet.fleet.processes import StartupError


class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class SseEvent:
    id: str
    event: str
    data: str
    received: float  # time.perf_counter() when its bytes arrived


class Connection:
    """One keep-alive connection; requests on it run one after another."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        self.headers = headers or {}  # sent with every request (an API key)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return self._reader, self._writer

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._reader = self._writer = None

    async def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> None:
        _, writer = await self._open()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in {**self.headers, **headers}.items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))

    async def _head(self) -> tuple[int, dict[str, str]]:
        reader, _ = await self._open()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]) -> bytes:
        reader, _ = await self._open()
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        parts = [chunk async for chunk in self._chunks()]
        return b"".join(parts)

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader, _ = await self._open()
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]

    async def request(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        """Sends a request (JSON body if payload is given), returns the status and the decoded JSON."""
        body = None if payload is None else json.dumps(payload).encode()
        await self._send(method, path, body, {})
        status, headers = await self._head()
        raw = await self._body(headers)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, json.loads(raw) if raw else None

    async def json(self, method: str, path: str, payload: Any = None, expect: int = 200) -> Any:
        status, body = await self.request(method, path, payload)
        if status != expect:
            raise HttpError(status, json.dumps(body).encode())
        return body

    async def events(self, path: str, payload: Any = None) -> AsyncIterator[SseEvent]:
        """The SSE events of a streaming GET (or, with a payload, a POST of it as JSON), each stamped
        with its arrival time."""
        method, body = ("GET", None) if payload is None else ("POST", json.dumps(payload).encode())
        await self._send(method, path, body, {"Accept": "text/event-stream"})
        status, headers = await self._head()
        if status != 200:
            raise HttpError(status, await self._body(headers))
        buffer = b""
        async for chunk in self._chunks():
            received = time.perf_counter()
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                event = _parse_frame(frame, received)
                if event is not None:
                    yield event


def _parse_frame(frame: bytes, received: float) -> SseEvent | None:
    entry_id = kind = ""
    data: list[str] = []
    for line in frame.decode().split("\n"):
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line.startswith("id:"):
            entry_id = line[3:].strip()
        elif line.startswith("event:"):
            kind = line[6:].strip()
    if not data and not kind:
        return None  # a comment (keep-alive)
    return SseEvent(entry_id, kind or "message", "\n".join(data), received)


async def served_model(url: str) -> str:
    connection = Connection(url)
    try:
        models = await connection.json("GET", "/v1/models")
    finally:
        await connection.close()
    names = [m["id"] for m in models["data"]]
    if len(names) != 1:
        raise StartupError(f"{url} serves {names or 'no model'}: pick one with --name")
    name: str = names[0]
    return name
