"""Recovery on the default model: a greedy job whose worker is killed mid-stream resumes on another worker
and writes the text of an uninterrupted run, whether its tokens were streamed one by one, a few at a time
or coalesced. A module of its own, so that it runs beside tests/test_recovery.py in another process."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet, RedisServer
from tests.jobs_client import read_events, streamed_text, wait_done
from tests.test_reliability import assert_contiguous, kill_while_streaming, reference_output

PROMPT = "Once upon a time, in a quiet village,"
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, str]:
    """The text of an uninterrupted greedy run of PROMPT on the default model (under "text"): run by the
    module's first test through its fleet, and kept for the others, as greedy decoding writes the same text
    on any worker of the model whatever its stream settings."""
    return {}


@pytest.mark.default_model
@pytest.mark.parametrize(
    ("kill_at", "stream_interval", "coalescing"),
    [(8, 1, False), (40, 1, False), (40, 4, False), (40, 1, True)],
)
async def test_a_greedy_job_resumed_after_a_kill_on_the_default_model_writes_the_uninterrupted_text(
    redis_server: RedisServer,
    default_model: Path,
    uninterrupted: dict[str, str],
    kill_at: int,
    stream_interval: int,
    coalescing: bool,
) -> None:
    # With a stream interval, or coalescing (here at any rate: 1 job write a second is the aim, so a
    # job's tokens wait up to ORTFLEET_STREAM_COALESCE_MS), the killed worker takes the tokens it held
    # back with it: the next attempt generates them again.
    fleet = Fleet(redis_server.url, default_model)
    name = f"smollm2-resume-{kill_at}-{stream_interval}-{int(coalescing)}"
    env = {
        "ORTFLEET_STEP_DELAY_S": "0.03",
        "ORTFLEET_HEARTBEAT_TTL_S": "2",
        "ORTFLEET_STREAM_INTERVAL": str(stream_interval),
        "ORTFLEET_STREAM_WRITES_PER_S": "1" if coalescing else "2000",
        "ORTFLEET_STREAM_COALESCE_MS": "120",
    }
    try:
        fleet.start_gateway()
        first = fleet.start_worker(name, env=env)
        second = fleet.start_worker(name, env=env)
        body = {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
            if "text" not in uninterrupted:
                uninterrupted["text"] = await reference_output(client, body)
            expected = uninterrupted["text"]
            job = await kill_while_streaming(client, body, first, second, kill_at)
            done = await wait_done(client, job["id"])
            events = await read_events(client, job["id"])
    finally:
        with contextlib.suppress(Exception):
            fleet.stop_all()
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert kill_at <= done["resumed_from"] < MAX_TOKENS
    assert done["resume_exact"] is True
    assert done["output"] == expected == streamed_text(events)
    assert len(assert_contiguous(events)) == MAX_TOKENS
    if coalescing:  # the tokens did wait: with steps 30 ms apart, about four to an event
        tokens = [event for event in events if event.event == "token"]
        assert len(tokens) <= MAX_TOKENS / 2, f"{len(tokens)} token events for {MAX_TOKENS} tokens"
