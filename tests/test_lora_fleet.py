"""LoRA adapters served through the fleet: a worker started with `--lora NAME=PATH` registers its adapters,
/v1/models lists each with its model as `parent`, and a request whose `model` is an adapter's name runs on
that model's workers with the adapter (OpenAI routes and the job API alike). Workers whose adapters do not
fit the model, differ from their name's other workers', or run on an engine without adapters exit at
start, naming why. A batch's lines name adapters as requests do."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.test_batches import jsonl, line, until_status, upload
from tests.test_cli import ortfleet
from tests.test_lora import alone, write_adapter
from tests.test_observability import value
from tests.test_startup_mistakes import Exited, assert_one_line, clean_env, run_to_exit
from worker.engines.batcher.engine import BatchingEngine

PROMPT = "Once upon a time"
TOKENS = 16


@pytest.fixture
def adapters(tmp_path: Path, tiny_model: Path, model_name: str) -> dict[str, Path]:
    """Two adapters under names unique to the test: one that changes the model's text, one whose B is 0."""
    return {
        f"{model_name}-sql": write_adapter(tmp_path / "sql", tiny_model, seed=1, strength=2.0),
        f"{model_name}-zero": write_adapter(tmp_path / "zero", tiny_model, zero_b=True),
    }


@pytest.fixture
async def expected(
    tiny_model: Path, adapters: dict[str, Path], model_name: str
) -> AsyncIterator[dict[str, list[int]]]:
    """Each adapter's greedy tokens of PROMPT alone, and the model's (under its name), from the batcher in
    this process with the same adapters."""
    engine = BatchingEngine(tiny_model, adapters=adapters)
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        yield {name or model_name: await alone(engine, prompt, name, TOKENS) for name in (*adapters, None)}
    finally:
        engine.close()


def lora_flags(adapters: dict[str, Path]) -> list[str]:
    return [flag for name, path in adapters.items() for flag in ("--lora", f"{name}={path}")]


async def job_tokens(client: httpx.AsyncClient, model: str) -> tuple[list[int], str]:
    """The token ids and text of a greedy job of PROMPT on `model`, through the job API."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    job = await submit(client, body)
    events = await read_events(client, job["id"])
    assert events[-1].event == "done", events[-1]
    return [token for e in events if e.event == "token" for token in e.data["token_ids"]], streamed_text(
        events
    )


def chat_text(sdk: openai.OpenAI, model: str) -> str:
    reply = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0
    )
    assert reply.model == model
    return reply.choices[0].message.content or ""


async def test_models_lists_each_adapter_with_its_model_as_parent_and_an_unknown_name_is_404(
    fleet: Fleet, client: httpx.AsyncClient, sdk: openai.OpenAI, model_name: str, adapters: dict[str, Path]
) -> None:
    fleet.start_worker(model_name, *lora_flags(adapters))

    listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}

    assert listed[model_name]["parent"] is None
    for name, path in adapters.items():
        assert listed[name]["parent"] == model_name
        assert listed[name]["root"] == str(path)
        assert listed[name]["object"] == "model"
        one = await client.get(f"/v1/models/{name}")
        assert one.status_code == 200 and one.json()["parent"] == model_name
    assert sorted(m.id for m in sdk.models.list() if m.id.startswith(model_name)) == sorted(
        [model_name, *adapters]
    )
    with pytest.raises(openai.NotFoundError):
        chat_text(sdk, f"{model_name}-unknown")
    assert (
        await client.post("/v1/jobs", json={"model": f"{model_name}-unknown", "prompt": "x"})
    ).status_code == 404


async def test_a_request_naming_an_adapter_gets_the_tokens_of_the_model_with_that_adapter(
    fleet: Fleet,
    client: httpx.AsyncClient,
    sdk: openai.OpenAI,
    model_name: str,
    adapters: dict[str, Path],
    expected: dict[str, list[int]],
) -> None:
    sql, zero = adapters
    assert expected[sql] != expected[model_name]  # the adapter does change the text
    fleet.start_worker(model_name, *lora_flags(adapters))

    texts = {}
    for name in (sql, zero, model_name):
        tokens, texts[name] = await job_tokens(client, name)
        assert tokens == expected[name]

    base = chat_text(sdk, model_name)
    with_sql = chat_text(sdk, sql)
    assert with_sql != base
    assert chat_text(sdk, sql) == with_sql
    assert chat_text(sdk, zero) == base
    completion = sdk.completions.create(model=sql, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert completion.model == sql
    assert completion.choices[0].text == texts[sql]


async def test_a_paged_worker_serves_its_adapters_with_the_batchers_tokens_alone_and_together(
    fleet: Fleet,
    client: httpx.AsyncClient,
    model_name: str,
    adapters: dict[str, Path],
    expected: dict[str, list[int]],
) -> None:
    sql, zero = adapters
    fleet.start_worker(model_name, *lora_flags(adapters), env={"ORTFLEET_SCHEDULER": "paged"})

    for name in (sql, zero, model_name):
        tokens, _ = await job_tokens(client, name)
        assert tokens == expected[name]
    named = (sql, model_name, zero, sql, model_name)
    together = await asyncio.gather(*(job_tokens(client, name) for name in named))  # rows of one batch
    assert [tokens for tokens, _ in together] == [expected[n] for n in named]


def worker_to_exit(fleet: Fleet, model: Path, name: str, lora: str, folder: Path) -> Exited:
    """A CPU worker of `model` served as `name` with the adapter `lora` (NAME=PATH), run until it exits."""
    argv = ["worker", "--model", str(model), "--name", name, "--device", "cpu", "--lora", lora]
    return run_to_exit(argv, clean_env(ORTFLEET_REDIS_URL=fleet.redis_url), folder)


def test_a_worker_whose_adapter_does_not_fit_the_model_exits_naming_the_mismatch(
    fleet: Fleet, tiny_model: Path, tmp_path: Path, model_name: str
) -> None:
    wrong = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 7), np.float32)}
    misfit = write_adapter(tmp_path / "misfit", tiny_model, tensors=wrong)

    exited = worker_to_exit(fleet, tiny_model, model_name, f"misfit={misfit}", tmp_path)

    assert_one_line(exited, "ortfleet-worker", "'misfit'", str(misfit), "q_proj", "[4, 7]", "--lora")


def test_a_worker_with_other_adapters_than_a_live_worker_of_its_name_exits_naming_both(
    fleet: Fleet, tiny_model: Path, tmp_path: Path, model_name: str, adapters: dict[str, Path]
) -> None:
    sql, zero = adapters
    fleet.start_worker(model_name, "--lora", f"{sql}={adapters[sql]}")

    exited = worker_to_exit(fleet, tiny_model, model_name, f"{zero}={adapters[zero]}", tmp_path)

    assert_one_line(exited, "ortfleet-worker", repr(model_name), sql, zero, "same adapters")


def test_a_worker_whose_engine_serves_no_adapters_exits_naming_the_batcher(
    fleet: Fleet, tmp_path: Path, model_name: str, adapters: dict[str, Path]
) -> None:
    exited = run_to_exit(
        ["worker", "--fake-engine", "1:4", "--name", model_name],
        clean_env(
            ORTFLEET_REDIS_URL=fleet.redis_url, ORTFLEET_LORA_MODULES=json.dumps({"sql": str(tmp_path)})
        ),
        tmp_path,
    )

    assert_one_line(exited, "ortfleet-worker", "sql", "ORTFLEET_LORA_MODULES", "batcher", "a fake engine")


async def test_answers_metrics_status_and_the_console_name_the_adapter_a_request_named(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, adapters: dict[str, Path]
) -> None:
    sql, zero = adapters
    port = free_port()
    fleet.start_worker(model_name, *lora_flags(adapters), "--metrics-port", str(port))

    jobs = {}
    for model in (sql, model_name):
        job = await submit(client, {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
        assert job["model"] == model
        jobs[model] = await wait_done(client, job["id"])
        assert jobs[model]["status"] == "succeeded" and jobs[model]["model"] == model
    body = {"model": sql, "input": PROMPT, "max_output_tokens": TOKENS, "temperature": 0}
    response = (await client.post("/v1/responses", json=body)).json()
    assert response["model"] == sql, response

    generated = {
        sql: jobs[sql]["usage"]["completion_tokens"] + response["usage"]["output_tokens"],
        "": jobs[model_name]["usage"]["completion_tokens"],
        zero: 0,
    }
    ended = {sql: 2, "": 1, zero: 0}
    deadline = time.monotonic() + 15  # a job's figures are counted just after its record says it ended
    while True:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        counted = {a: value(text, "ortfleet_adapter_requests_total", adapter=a) for a in ended}
        tokens = {a: value(text, "ortfleet_adapter_generation_tokens_total", adapter=a) for a in generated}
        if counted == ended and tokens == generated:
            break
        assert time.monotonic() < deadline, (counted, tokens)
        await asyncio.sleep(0.1)
    assert value(text, "ortfleet_jobs_finished_total", model=model_name) == 3  # the model's series: all

    shown = ortfleet("status", "--redis-url", fleet.redis_url, "--json")
    assert shown.returncode == 0, shown.stderr
    [model] = [m for m in json.loads(shown.stdout)["models"] if m["name"] == model_name]
    assert model["adapters"] == sorted(adapters)
    table = ortfleet("status", "--redis-url", fleet.redis_url)
    assert f"{model_name} adapters: {', '.join(sorted(adapters))}" in table.stdout.splitlines()
    overview = (await client.get("/v1/fleet")).json()
    assert next(m for m in overview["models"] if m["id"] == model_name)["adapters"] == sorted(adapters)


async def test_a_batch_whose_lines_name_adapters_answers_each_line_with_the_text_of_its_request_alone(
    fleet: Fleet, sdk: openai.OpenAI, model_name: str, adapters: dict[str, Path]
) -> None:
    """Lines naming an adapter and lines naming the model, in one batch, which the worker runs side by side
    (six jobs, eight rows): each answer names the line's model and holds the text of its request alone."""
    sql, zero = adapters
    fleet.start_worker(model_name, *lora_flags(adapters))
    prompts = [PROMPT, "The capital of France is"]
    lines = [
        line(f"{model}-{i}", model, prompt, max_tokens=TOKENS, temperature=0)
        for i, prompt in enumerate(prompts)
        for model in (sql, model_name, zero)
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )

    batch = await until_status(sdk, created.id, "completed")

    answers = {answer["custom_id"]: answer["response"] for answer in jsonl(sdk, batch.output_file_id)}
    assert sorted(answers) == sorted(entry["custom_id"] for entry in lines)
    texts = {}
    for entry in lines:
        response = answers[entry["custom_id"]]
        assert response["status_code"] == 200, response
        assert response["body"]["model"] == entry["body"]["model"]
        texts[entry["custom_id"]] = response["body"]["choices"][0]["message"]["content"]
        alone = await asyncio.to_thread(sdk.chat.completions.create, **entry["body"])
        assert texts[entry["custom_id"]] == alone.choices[0].message.content, entry["custom_id"]
    for i in range(len(prompts)):  # the adapters did run: one changes the model's text, one (B = 0) not
        assert texts[f"{sql}-{i}"] != texts[f"{model_name}-{i}"] == texts[f"{zero}-{i}"]
