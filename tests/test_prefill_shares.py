"""One key's short requests never set another key's time per token (worker/engines/work_shares.py), on
the default model, through a real gateway and worker, on the batcher and on the paged engine.

One key floods the worker with plain 1-token chats of a 90-token prompt from four clients at once, well
within its limits: every one of them is a prompt to prefill. Another key's greedy 20-token chat, timed
alone and then under that flood in the same test, must take at most 2.5 times as long, and the flooding
key must still be served while it waits its turn."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet, RedisServer
from tests.test_security import bearer, create_key

pytestmark = pytest.mark.default_model

FLOOD_CLIENTS = 4
FLOOD_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 5)
CHAT = {
    "messages": [{"role": "user", "content": "List the planets of the solar system, one per line."}],
    "max_tokens": 20,
    "min_tokens": 20,
    "temperature": 0,
}
RUNS = 5
MAX_SLOWDOWN = 2.5


async def _chat_seconds(client: httpx.AsyncClient, model: str) -> float:
    began = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
    took = time.perf_counter() - began
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 20
    return took


class Flood:
    """The flooding key's clients, and how many of its requests were served."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.served = 0
        self.under_way = asyncio.Event()  # each client got a request served
        self._stop = asyncio.Event()
        body = {"model": model, "messages": [{"role": "user", "content": FLOOD_PROMPT}], "max_tokens": 1}
        self._tasks = [asyncio.create_task(self._client(client, body)) for _ in range(FLOOD_CLIENTS)]

    async def _client(self, client: httpx.AsyncClient, body: dict[str, object]) -> None:
        while not self._stop.is_set():
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            self.served += 1
            if self.served >= 2 * FLOOD_CLIENTS:
                self.under_way.set()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


@pytest.mark.parametrize("scheduler", ["batcher", "paged"])
async def test_a_key_flooding_short_requests_leaves_another_keys_chat_within_its_share(
    scheduler: str, redis_server: RedisServer, default_model: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.json"
    suffix = secrets.token_hex(3)
    flooding = create_key(key_file, f"flood-{suffix}")
    chatting = create_key(key_file, f"chat-{suffix}")
    model = f"smollm2-shares-{scheduler}"
    fleet = Fleet(redis_server.url, default_model)
    try:
        fleet.start_gateway(env={"ORTFLEET_API_KEYS_FILE": str(key_file)})
        fleet.start_worker(model, env={"ORTFLEET_SCHEDULER": scheduler})
        async with (
            httpx.AsyncClient(base_url=fleet.gateway_url, timeout=300, headers=bearer(flooding)) as flood,
            httpx.AsyncClient(base_url=fleet.gateway_url, timeout=300, headers=bearer(chatting)) as chat,
        ):
            await _chat_seconds(chat, model)  # its prompt's blocks cached, as in every later run
            alone = statistics.median([await _chat_seconds(chat, model) for _ in range(RUNS)])

            flooding_clients = Flood(flood, model)
            await flooding_clients.under_way.wait()  # the flood is under way before the chat is timed
            flood_began, served_before = time.perf_counter(), flooding_clients.served
            crowded = statistics.median([await _chat_seconds(chat, model) for _ in range(RUNS)])
            flood_window = time.perf_counter() - flood_began
            served_during = flooding_clients.served - served_before
            await flooding_clients.stop()
    finally:
        fleet.stop_all()

    assert crowded <= MAX_SLOWDOWN * alone, (
        f"another key's 20-token chat took {crowded:.2f} s under the flood against {alone:.2f} s alone"
    )
    # the flooding key is not shut out: it keeps getting its requests done while the chats run
    served = f"the flooding key got {served_during} requests done in {flood_window:.1f} s"
    assert served_during >= RUNS, served
