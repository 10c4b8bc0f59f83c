"""OpenAI's Batch API, driven by the official `openai` SDK: durable in Redis, driven by whichever gateway
holds a batch's lease, so it completes through the deaths of gateways and workers."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis

from gateway.batches.lines import answer_line
from tests.conftest import Fleet, RedisServer, keys

FAST_DRIVER = {"ORTFLEET_BATCH_TICK_S": "0.05", "ORTFLEET_BATCH_LEASE_S": "1"}


BatchFleet = Callable[..., tuple[Fleet, openai.OpenAI]]


@pytest.fixture
def batch_fleet(redis_server: RedisServer, tiny_model: Path, model_name: str) -> Iterator[BatchFleet]:
    """Starts a gateway (with a fast batch driver and the settings given) and a worker of the test's model."""
    started: list[tuple[Fleet, openai.OpenAI]] = []

    def start(worker_env: dict[str, str] | None = None, **env: str) -> tuple[Fleet, openai.OpenAI]:
        fleet = Fleet(redis_server.url, tiny_model, env={**FAST_DRIVER, **env})
        fleet.start_gateway()
        sdk = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0)
        started.append((fleet, sdk))
        fleet.start_worker(model_name, env=worker_env)
        return fleet, sdk

    yield start
    for fleet, sdk in started:
        sdk.close()
        fleet.stop_all()


def line(custom_id: str, model: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body},
    }


def upload(sdk: openai.OpenAI, lines: list[Any]) -> str:
    raw = "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines)
    return sdk.files.create(file=("in.jsonl", io.BytesIO(raw.encode())), purpose="batch").id


async def until_status(sdk: openai.OpenAI, batch_id: str, *statuses: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await asyncio.to_thread(sdk.batches.retrieve, batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}: {batch}"
        await asyncio.sleep(0.1)


def status_json(redis_url: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "ortfleet", "status", "--redis-url", redis_url, "--json"]
    status: dict[str, Any] = json.loads(
        subprocess.run(command, capture_output=True, text=True, check=True).stdout
    )
    return status


def jsonl(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(raw) for raw in sdk.files.content(file_id).text.splitlines()]


async def test_a_batch_answers_every_line_in_its_output_file_with_its_custom_id(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet()
    # The tiny model's weights are random: a sampled first token may end the text, so each line asks for one.
    lines = [line(f"req-{i}", model_name, f"say {i}", min_tokens=1) for i in range(6)]
    input_id = upload(sdk, lines)
    created = sdk.batches.create(
        input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
    )
    assert created.status == "validating"
    batch = await until_status(sdk, created.id, "completed")
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        6,
        6,
        0,
    )
    assert batch.metadata == {"k": "v"} and batch.error_file_id is None
    output = jsonl(sdk, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(6))
    for answer in output:
        assert answer["response"]["status_code"] == 200
        assert answer["response"]["body"]["object"] == "chat.completion"
        assert answer["response"]["body"]["usage"]["completion_tokens"] > 0
    assert created.id in [b.id for b in sdk.batches.list()]


async def test_a_line_the_endpoint_refuses_goes_to_the_error_file_with_its_line_number(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet()
    lines = [
        line("good", model_name, "hi"),
        line("bad-tokens", model_name, "hi", max_tokens=-3),
        line("bad-model", "no-such-model", "hi"),
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await until_status(sdk, created.id, "completed")
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    errors = {e["custom_id"]: e for e in jsonl(sdk, batch.error_file_id)}
    assert errors["bad-tokens"]["line"] == 2 and errors["bad-tokens"]["response"]["status_code"] == 400
    assert "max_tokens" in errors["bad-tokens"]["response"]["body"]["error"]["message"]
    assert errors["bad-model"]["line"] == 3 and errors["bad-model"]["response"]["status_code"] == 404
    assert [o["custom_id"] for o in jsonl(sdk, batch.output_file_id)] == ["good"]


async def test_a_malformed_input_file_fails_validation_naming_its_line(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet()
    lines: list[Any] = [line("a", model_name, "hi"), "{not json", line("a", model_name, "again")]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await until_status(sdk, created.id, "failed")
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
    ]
    assert batch.failed_at is not None and batch.output_file_id is None


@pytest.mark.parametrize(
    ("hostile", "code"),
    [
        ('{"custom_id": "x", "body": {"max_tokens": ' + "9" * 5000 + "}}", "number_too_long"),
        ("[" * 50_000 + "]" * 50_000, "json_too_deep"),
    ],
    ids=["a-5000-digit-number", "50000-levels-of-nesting"],
)
async def test_a_line_the_json_parser_cannot_take_fails_its_batch_and_another_batch_completes_meanwhile(
    batch_fleet: BatchFleet, model_name: str, hostile: str, code: str
) -> None:
    _, sdk = batch_fleet()
    malformed = sdk.batches.create(
        input_file_id=upload(sdk, [line("a", model_name, "hi"), hostile]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    ordinary = sdk.batches.create(
        input_file_id=upload(sdk, [line(f"req-{i}", model_name, f"say {i}") for i in range(3)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )

    failed = await until_status(sdk, malformed.id, "failed", "completed", timeout_s=60)
    completed = await until_status(sdk, ordinary.id, "completed", "failed", timeout_s=60)

    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.line, e.code) for e in failed.errors.data] == [(2, code)]
    assert completed.status == "completed" and completed.request_counts is not None
    assert completed.request_counts.completed == 3


async def test_cancelling_a_batch_stops_feeding_it_and_keeps_what_finished_and_status_shows_it_before(
    batch_fleet: BatchFleet, model_name: str, redis: Redis
) -> None:
    fleet, sdk = batch_fleet({"ORTFLEET_STEP_DELAY_S": "0.02"}, ORTFLEET_BATCH_MAX_IN_FLIGHT="2")
    lines = [line(f"c{i}", model_name, "count slowly", max_tokens=64) for i in range(40)]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    await until_status(sdk, created.id, "in_progress")
    status = await asyncio.to_thread(status_json, fleet.redis_url)
    shown = {b["id"]: b for b in status["batches"]}
    assert shown[created.id]["status"] == "in_progress" and shown[created.id]["total"] == 40
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(fleet.gateway_url + "/metrics")).text
    assert 'ortfleet_batches_active{status="in_progress"}' in metrics
    assert 'ortfleet_batch_requests{state="total"}' in metrics
    cancelling = sdk.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = await until_status(sdk, created.id, "cancelled")
    assert batch.request_counts is not None
    answered = batch.request_counts.completed + batch.request_counts.failed
    assert answered < 40  # the rest was never fed
    assert batch.cancelled_at is not None
    assert await redis.zscore(keys.batches_active, created.id) is None


async def test_a_batch_past_its_window_expires_and_its_unrun_lines_go_to_the_error_file(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet(ORTFLEET_BATCH_WINDOW_S="1.5", ORTFLEET_BATCH_MAX_IN_FLIGHT="1")
    lines = [line(f"e{i}", model_name, "write a lot", max_tokens=200) for i in range(30)]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await until_status(sdk, created.id, "expired")
    assert batch.request_counts is not None and batch.expired_at is not None
    assert batch.request_counts.completed + batch.request_counts.failed == 30
    expired = [
        e for e in jsonl(sdk, batch.error_file_id) if (e.get("error") or {}).get("code") == "batch_expired"
    ]
    assert expired and all(isinstance(e["line"], int) for e in expired)


async def test_a_batch_completes_through_a_killed_worker_and_gateway_answering_each_line_once(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    fleet, _ = batch_fleet(ORTFLEET_BATCH_MAX_IN_FLIGHT="4")
    doomed_worker = fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.02"})
    doomed_gateway = fleet.gateways[0]
    first_url = fleet.gateway_url
    count = 24
    with openai.OpenAI(base_url=first_url + "/v1", api_key="unused", max_retries=0) as first:
        lines = [line(f"k{i}", model_name, f"number {i}", max_tokens=24) for i in range(count)]
        created = first.batches.create(
            input_file_id=upload(first, lines), endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while first.batches.retrieve(created.id).request_counts.completed < 4:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    _, second_url = fleet.start_gateway()
    doomed_gateway.kill()  # the batch's only driver so far, mid-batch
    doomed_worker.kill()  # with lines of the batch running on it
    with openai.OpenAI(base_url=second_url + "/v1", api_key="unused", max_retries=0) as second:
        batch = await until_status(second, created.id, "completed", timeout_s=180)
        output = jsonl(second, batch.output_file_id)
    assert batch.request_counts is not None and batch.request_counts.failed == 0
    ids = [o["custom_id"] for o in output]
    assert sorted(ids) == sorted(f"k{i}" for i in range(count))  # every line, each exactly once
    assert len({o["response"]["request_id"] for o in output}) == count


async def test_an_error_line_carries_the_status_code_and_param_the_http_route_answers(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    """Refused at the gateway (a regex that does not compile) or failed on the worker (a logit_bias token
    outside the vocabulary, a prompt past the context): each error line says what HTTP would."""
    fleet, sdk = batch_fleet()
    bad = {
        "regex": {"guided_regex": "(unclosed"},
        "bias": {"logit_bias": {"10000000": 5}},
        "long": {"messages": [{"role": "user", "content": "The quick brown fox. " * 400}]},
    }
    lines = [
        line("good", model_name, "hi"),
        *(line(name, model_name, "hi", **extra) for name, extra in bad.items()),
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await until_status(sdk, created.id, "completed")
    errors = {e["custom_id"]: e["response"] for e in jsonl(sdk, batch.error_file_id)}
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
        for name in bad:
            direct = await client.post(
                "/v1/chat/completions", json=line(name, model_name, "hi", **bad[name])["body"]
            )
            assert direct.status_code == 400, direct.text
            expected = direct.json()["error"]
            answered = errors[name]["body"]["error"]
            assert errors[name]["status_code"] == direct.status_code, (name, errors[name])
            assert (answered["code"], answered["param"]) == (expected["code"], expected["param"]), name
    assert [o["custom_id"] for o in jsonl(sdk, batch.output_file_id)] == ["good"]


async def test_a_batchs_input_file_cannot_be_deleted_while_the_batch_runs_and_every_line_is_answered(
    batch_fleet: BatchFleet, model_name: str
) -> None:
    _, sdk = batch_fleet()
    input_id = upload(sdk, [line(f"req-{i}", model_name, f"say {i}") for i in range(20)])
    created = sdk.batches.create(
        input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.ConflictError) as refused:
        sdk.files.delete(input_id)
    assert refused.value.status_code == 409 and refused.value.code == "file_in_use"
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "file_id"
    assert created.id in refused.value.message
    batch = await until_status(sdk, created.id, "completed")
    assert batch.request_counts is not None and batch.request_counts.completed == 20
    assert len(jsonl(sdk, batch.output_file_id)) == 20
    assert sdk.files.delete(input_id).deleted  # the batch has ended: the file is the key's to delete


@pytest.mark.unit
def test_an_answer_with_unicode_line_breaks_stays_one_line_of_its_file() -> None:
    """JSON leaves U+0085, U+2028 and U+2029 raw inside strings, where Python's splitlines (and older
    JavaScript) breaks lines: an output line escapes them, so every reader finds one record a line."""
    text = "one\x85two\u2028three\u2029four é"
    line = answer_line("req-1", "job_x", 200, {"choices": [{"message": {"content": text}}]})
    assert line.endswith("\n") and len(line.splitlines()) == 1
    assert json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] == text
    assert "é" in line  # other text stays as it is
