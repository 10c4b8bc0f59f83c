"""An OpenAI-compatible stand-in that answers one request per connection though its `Keep-Alive` header
promises more: the socket closes once a streamed response's last chunk is written, as llama.cpp's
llama-server does, and after any other answer the next request on the connection finds it closed
unanswered, as when a server's keep-alive timeout crosses a request on the wire. Raw asyncio, so nothing
between it and the socket decides otherwise.

`python -m tests.closing_server` listens on a free port and prints `listening on PORT`. It serves
`GET /v1/models` (one model, `stand-in`), streamed `POST /v1/completions` (a chunk per token, greedy
words, `max_tokens` of them, usage when `stream_options.include_usage`, then `[DONE]`) and
`GET /connections` (how many connections it has accepted, on a connection it then keeps open).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

MODEL = "stand-in"
TOKEN_GAP_S = 0.001  # between two streamed tokens


class ClosingServer:
    def __init__(self) -> None:
        self.accepted = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            request = await _read_request(reader)
            if request is None:
                return
            method, path, body = request
            if method == "POST" and path == "/v1/completions" and body.get("stream"):
                await _stream_completion(writer, body)
                return
            await _answer(writer, *self.answer(method, path))
            await _read_request(reader)  # the next request on the connection, if one comes: unanswered
        finally:
            writer.close()

    def answer(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        if method == "GET" and path == "/v1/models":
            return 200, {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "me"}],
            }
        if method == "GET" and path == "/connections":
            return 200, {"accepted": self.accepted}
        return 404, {"error": {"message": f"no {method} {path}", "code": 404}}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, Any]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed it
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ")
    headers = dict(line.lower().split(": ", 1) for line in header_lines if line)
    length = int(headers.get("content-length", 0))
    body = json.loads(await reader.readexactly(length)) if length else {}
    return method, path, body


async def _answer(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    writer.write(
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Keep-Alive: timeout=5, max=100\r\n\r\n".encode()
        + body
    )
    await writer.drain()


async def _stream_completion(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"Keep-Alive: timeout=5, max=100\r\n\r\n"
    )
    tokens = int(body["max_tokens"])
    for i in range(tokens):
        choice = {"index": 0, "text": f" word{i}", "logprobs": None, "finish_reason": None}
        if i == tokens - 1:
            choice["finish_reason"] = "length"
        await _event(writer, _chunk(body, [choice]))
        await asyncio.sleep(TOKEN_GAP_S)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        await _event(writer, {**_chunk(body, []), "usage": usage})
    await _event(writer, "[DONE]")
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def _chunk(body: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
    model = body["model"]
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": model, "choices": choices}


async def _event(writer: asyncio.StreamWriter, data: dict[str, Any] | str) -> None:
    frame = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
    writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
    await writer.drain()


async def main() -> None:
    server = await asyncio.start_server(ClosingServer().handle, "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
