"""End to end on the real default model: SmolLM2-135M-Instruct, int4, CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet, RedisServer
from tests.jobs_client import read_events, streamed_text, submit, wait_done

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="session")
def default_model() -> Path:
    from common.modelbuild.default import ensure_default_model
    from common.settings import FleetSettings

    return ensure_default_model(FleetSettings().model_cache)


async def test_the_default_model_answers_that_the_capital_of_france_is_paris(
    redis_server: RedisServer, default_model: Path
) -> None:
    fleet = Fleet(redis_server.url, default_model)
    try:
        fleet.start_gateway()
        fleet.start_worker("smollm2")
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
            job = await submit(
                client,
                {
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 40,
                },
            )
            events = await read_events(client, job["id"])
            done = await wait_done(client, job["id"])
    finally:
        fleet.stop_all()
    assert done["status"] == "succeeded", done
    assert "Paris" in done["output"]
    assert streamed_text(events) == done["output"]
    assert done["finish_reason"] in ("stop", "length")
