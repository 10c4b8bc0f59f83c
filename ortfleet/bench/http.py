"""The benches' HTTP client: JSON requests and SSE streams over httpx, one connection at a time.

A `Connection` is one client's: its requests run one after another on a keep-alive HTTP/1.1 connection,
and one the server has closed (llama.cpp's llama-server closes it after every streamed response) is
opened again for the next request, which goes again if the close crossed it on the wire. SSE bodies are
read raw and split by `ortfleet.bench.sse`, each event stamped with the time its bytes arrived.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from ortfleet.bench.sse import SseDecoder, SseEvent
from ortfleet.fleet.processes import StartupError

CONNECT_TIMEOUT_S = 30.0  # reads have no limit: a long prefill or a ?wait= long poll is still an answer
EVENT_HEADERS = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}  # raw bytes are the events


class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class Connection:
    """One client's connection to the server at `base_url` (its root: the benches' paths start at /v1);
    `headers` go with every request (an API key)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.headers = headers or {}
        self._client = self._new_client()
        self._kept = False  # an answer was read whole since the last close: its connection may be kept

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers=self.headers,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            # plain HTTP needs no TLS context, and httpx builds one per client (about 50 ms of CPU)
            verify=self.base_url.startswith("https:"),
            trust_env=False,  # no proxy from the environment between a bench and its server
        )

    async def close(self) -> None:
        """Closes the connection; the next request opens another."""
        await self._client.aclose()
        self._client = self._new_client()
        self._kept = False

    async def json(self, method: str, path: str, payload: Any = None, expect: int = 200) -> Any:
        request = self._client.build_request(method, path, json=payload)
        response = await self._send(request, stream=False)
        if response.status_code != expect:
            raise HttpError(response.status_code, response.content)
        return json.loads(response.content) if response.content else None

    async def events(self, path: str, payload: Any = None) -> AsyncIterator[SseEvent]:
        """The SSE events of a streaming GET (or, with a payload, a POST of it as JSON), each stamped
        with its arrival time."""
        method = "GET" if payload is None else "POST"
        request = self._client.build_request(method, path, json=payload, headers=EVENT_HEADERS)
        response = await self._send(request, stream=True)
        try:
            if response.status_code != 200:
                raise HttpError(response.status_code, await response.aread())
            decoder = SseDecoder()
            async for chunk in response.aiter_raw():
                for event in decoder.feed(chunk, time.perf_counter()):
                    yield event
            self._kept = True
        except httpx.TransportError as e:
            raise ConnectionError(f"{method} {request.url}: {e!r}") from e
        finally:
            await response.aclose()

    async def _send(self, request: httpx.Request, stream: bool) -> httpx.Response:
        """The answer's head (and body unless `stream`). A kept connection that fails before any answer
        was closed by the server as the request went out (llama-server closes its connection after
        every streamed response, any server after its keep-alive timeout): the request, which it never
        read, goes once more on a new connection."""
        retry, self._kept = self._kept, False
        while True:
            try:
                response = await self._client.send(request, stream=stream)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                if retry:
                    retry = False
                    continue
                raise ConnectionError(f"{request.method} {request.url}: {e!r}") from e
            except httpx.TransportError as e:
                raise ConnectionError(f"{request.method} {request.url}: {e!r}") from e
            self._kept = not stream
            return response


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


async def fleet_workers(url: str, model: str) -> dict[str, dict[str, Any]] | None:
    """The live workers of `model` as an ortfleet gateway's /v1/fleet lists them, by id (device, rows and
    tokens generated since each started); None from a server that has no such list or refuses it."""
    connection = Connection(url)
    try:
        fleet = await connection.json("GET", "/v1/fleet")
    except (HttpError, ConnectionError, ValueError):
        return None
    finally:
        await connection.close()
    try:
        return {
            w["id"]: {"device": w["device"], "rows": int(w["capacity"]), "tokens": int(w["generated_tokens"])}
            for w in fleet["workers"]
            if w["model"] == model
        }
    except (KeyError, TypeError, ValueError):
        return None
