"""The engine core (worker/core/): a worker's engine in a process of its own, or one core shared by
several workers, each with its share of the rows. On real processes: the same tokens as the engine in
the worker's own process, a core killed mid-stream (the worker starts a new one and its jobs resume
exactly), a frontend killed (only its rows resume), cancels, and the update crossing's every field."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common.error_codes import ErrorCode
from ortfleet.bench.core_host import measure, text
from ortfleet.bench.machine import child_pids
from ortfleet.fleet.launcher import serving_fleet
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import read_events, streamed_text, submit, wait_done
from tests.test_reliability import SLOW, assert_contiguous, stream_until_tokens
from worker.core.channel import Frames, frame
from worker.core.client import CoreGone, EngineCoreClient, SharedCore, SpawnedCore
from worker.core.commands import Submit, encode_command
from worker.core.facts import CoreFacts
from worker.core.step_wire import decode_step, encode_step
from worker.core.updates import pack, unpack
from worker.engine import EngineUpdate, Finish, GenerationRequest, TokenLogprobs

IN_A_CORE = {"ORTFLEET_ENGINE_CORE": "process"}


@pytest.mark.unit
def test_every_field_of_an_update_crosses_the_step_wire() -> None:
    top = ((5, -0.25), (9, -1.5))
    updates = [
        (3, EngineUpdate([1, 2], batch_rows=7)),
        (4, EngineUpdate([], Finish.error, "bad grammar", 7, ErrorCode.invalid_response_format)),
        (
            8,
            EngineUpdate(
                [11],
                None,
                batch_rows=7,
                replay_exact=False,
                logprobs=(TokenLogprobs(-0.5, top),),
                cached_tokens=64,
                prompt_logprobs=(TokenLogprobs(-2.0, ((3, -1.0),)),),
            ),
        ),
        (3, EngineUpdate([4], Finish.eos, batch_rows=6, closed_early=True, logprobs=(TokenLogprobs(-1.0),))),
    ]
    crossed = list(unpack(decode_step(encode_step(pack(12, updates)))))
    assert crossed == updates


@pytest.mark.unit
def test_a_step_without_rare_fields_carries_no_notes() -> None:
    step = pack(1, [(row, EngineUpdate([row], batch_rows=3)) for row in range(3)])
    assert step.notes == {} and step.logprobs is None and step.running == 3


def fake_core_args(spec: str) -> list[str]:
    return ["--fake-engine", spec]


async def collect(stream: Any) -> tuple[list[int], Finish]:
    tokens: list[int] = []
    while True:
        update = await stream.updates.get()
        tokens += update.token_ids
        if update.finish is not None:
            return tokens, update.finish


async def test_a_spawned_core_runs_requests_cancels_and_after_a_kill_ends_its_rows_lost_and_restarts() -> (
    None
):
    client = EngineCoreClient(SpawnedCore(fake_core_args("5:4"), 60))
    failures: list[str] = []
    client.on_failure = failures.append
    try:
        assert client.capacity == 4 and client.facts.engine == "fake" and client.facts.frontends == 1
        short, long = client.submit(
            [GenerationRequest([97], max_new_tokens=5), GenerationRequest([97], max_new_tokens=10_000)]
        )
        tokens, finish = await collect(short)
        assert finish is Finish.length and tokens == [98, 99, 100, 101, 102]  # b c d e f
        await long.updates.get()
        client.cancel(long)
        _, finish = await collect(long)
        assert finish is Finish.cancelled

        doomed = client.submit([GenerationRequest([97], max_new_tokens=10_000)])[0]
        await doomed.updates.get()
        os.kill(client.facts.core_pid, signal.SIGKILL)
        _, finish = await collect(doomed)
        assert finish is Finish.lost and failures and str(client.facts.core_pid) in failures[0]
        late = client.submit([GenerationRequest([97], max_new_tokens=2)])[0]
        assert (await late.updates.get()).finish is Finish.lost  # until restart
        old_pid = client.facts.core_pid
        await client.restart()
        assert client.facts.core_pid != old_pid
        tokens, finish = await collect(client.submit([GenerationRequest([1, 2], max_new_tokens=3)])[0])
        assert tokens == [99, 100, 101] and finish is Finish.length  # c d e: the letters of positions 2-4
    finally:
        client.close()


def start_shared_core(
    path: Path, fake_engine: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """An engine core of a fake engine serving two frontends at `path`."""
    command = [sys.executable, "-m", "worker.core", "--socket", str(path), "--frontends", "2"]
    return subprocess.Popen([*command, "--fake-engine", fake_engine], env={**os.environ, **(env or {})})


@pytest.fixture
def shared_core(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    path = tmp_path / "core.sock"
    core = start_shared_core(path, "5:8")
    yield path, core
    core.terminate()  # its frontends have gone: it stops at once
    assert core.wait(timeout=30) == 0


async def test_a_shared_core_gives_each_frontend_its_share_and_a_frontend_that_leaves_costs_only_its_rows(
    shared_core: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, _ = shared_core
    first = EngineCoreClient(SharedCore(path, 60))
    second = EngineCoreClient(SharedCore(path, 60))
    try:
        assert (first.capacity, second.capacity) == (4, 4)
        assert first.facts.core_pid == second.facts.core_pid
        with pytest.raises(CoreGone):  # both shares are taken: a third waits, then gives up
            SharedCore(path, 1.5).connect()
        staying = second.submit([GenerationRequest([97], max_new_tokens=60)])[0]
        leaving = first.submit([GenerationRequest([97], max_new_tokens=10_000)])[0]
        await leaving.updates.get()
        sock = first._sock
        assert sock is not None
        sock.shutdown(socket.SHUT_RDWR)  # as a frontend that died: no goodbye
        tokens, finish = await collect(staying)
        assert finish is Finish.length and len(tokens) == 60
        third = await asyncio.to_thread(EngineCoreClient, SharedCore(path, 60))  # takes the freed share
        try:
            assert third.capacity == 4
            tokens, finish = await collect(third.submit([GenerationRequest([97], max_new_tokens=3)])[0])
            assert (tokens, finish) == ([98, 99, 100], Finish.length)
        finally:
            third.close()
    finally:
        first.close()
        second.close()


async def test_a_shared_core_drops_a_frontend_that_stops_reading_and_the_other_frontend_goes_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "core.sock"
    core = start_shared_core(path, "1:8", {"ORTFLEET_ENGINE_CORE_STALL_S": "2"})
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        going = await asyncio.to_thread(EngineCoreClient, SharedCore(path, 60))
        stalled.connect(str(path))
        frames = read_available_blocking(stalled)  # its facts, then it reads nothing more
        assert CoreFacts.decode(frames[0]).capacity == 4
        stalled.sendall(frame(encode_command(Submit.of(0, GenerationRequest([97], max_new_tokens=10**9)))))
        # A request of its own on the other frontend, long enough to outlast the stalled one's buffers:
        # a core that waited on the stalled frontend would never finish it.
        stream = going.submit([GenerationRequest([97], max_new_tokens=4000)])[0]
        tokens, finish = await asyncio.wait_for(collect(stream), timeout=60)
        assert finish is Finish.length and len(tokens) == 4000
        stalled.settimeout(30)
        while stalled.recv(1 << 20):  # what the core sent before it dropped it, then its end closed
            pass
        going.close()
    finally:
        stalled.close()
        core.terminate()
        core.wait(timeout=30)


def read_available_blocking(sock: socket.socket) -> list[memoryview]:
    frames = Frames()
    while True:
        got = frames.split(sock.recv(1 << 16))
        if got:
            return got


async def test_a_worker_whose_engine_runs_in_a_core_writes_what_one_with_the_engine_in_process_writes(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name + "-in", "--scheduler", "batcher")
    worker = fleet.start_worker(model_name + "-core", "--scheduler", "batcher", env=IN_A_CORE)
    assert len(child_pids(worker.pid)) == 1
    body: dict[str, Any] = {
        "prompt": "The quick brown fox",
        "max_tokens": 40,
        "logprobs": 3,
        "temperature": 0,
    }
    answers = []
    for name in (model_name + "-in", model_name + "-core"):
        response = await client.post("/v1/completions", json={**body, "model": name})
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0])
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["text"]
    assert answers[0]["logprobs"] == answers[1]["logprobs"]
    cores = {w["model"]: w["engine_core"] for w in (await client.get("/v1/fleet")).json()["workers"]}
    assert cores[model_name + "-in"] == "in-process" and cores[model_name + "-core"] == "own"


@pytest.mark.parametrize("scheduler", ["batcher", "paged"])
async def test_a_core_killed_mid_stream_is_replaced_and_its_jobs_resume_with_no_gap(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str, scheduler: str
) -> None:
    worker = fleet.start_worker(model_name, "--scheduler", scheduler, env={**SLOW, **IN_A_CORE})
    body = {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 200}
    reference = await wait_done(client, (await submit(client, body))["id"])
    assert reference["status"] == "succeeded" and reference["attempts"] == 1
    (core,) = child_pids(worker.pid)
    job = await submit(client, body)
    await stream_until_tokens(client, job["id"], 30)
    os.kill(core, signal.SIGKILL)
    events = await read_events(client, job["id"])
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert done["output"] == reference["output"] and done["resume_exact"] is True
    assert len(assert_contiguous(events)) == done["usage"]["completion_tokens"]
    assert worker.alive() and child_pids(worker.pid) not in ([], [core])


async def test_with_a_shared_core_a_killed_worker_costs_only_its_own_rows(
    fleet: Fleet, client: httpx.AsyncClient, redis: Redis, model_name: str, tmp_path: Path, tiny_model: Path
) -> None:
    path = tmp_path / "core.sock"
    # Two rows, one for each worker: the second job runs on the worker the first does not.
    core = fleet.start_core(
        path, 2, "--scheduler", "batcher", "--max-batch-size", "2", model=tiny_model, device="cpu", env=SLOW
    )
    shared = {**SLOW, "ORTFLEET_ENGINE_CORE": f"unix:{path}"}
    workers = [fleet.start_worker(model_name, env=shared) for _ in range(2)]
    body = {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 200}
    reference = await wait_done(client, (await submit(client, body))["id"])
    staying_job = await submit(client, body)
    await stream_until_tokens(client, staying_job["id"], 10)
    doomed_job = await submit(client, body)
    await stream_until_tokens(client, doomed_job["id"], 10)
    holder = str(await redis.hget(keys.job(doomed_job["id"]), "worker"))  # type: ignore[misc]
    doomed = next(worker for worker in workers if f"-{worker.pid}-" in holder)
    doomed.kill()
    fleet_workers = (await client.get("/v1/fleet")).json()["workers"]
    assert {w["engine_core"] for w in fleet_workers if w["model"] == model_name} == {"shared"}
    staying, resumed = [await wait_done(client, job["id"]) for job in (staying_job, doomed_job)]
    assert staying["attempts"] == 1 and staying["output"] == reference["output"]  # untouched
    assert resumed["attempts"] == 2 and resumed["output"] == reference["output"]
    assert core.alive()
    fleet.stop_all()  # the workers, then the core: it stops once they have left
    assert core.process.returncode == 0


def test_a_serving_fleet_with_a_shared_core_splits_the_cores_rows_between_its_workers(
    tiny_model: Path,
) -> None:
    with (
        serving_fleet(tiny_model, "shared", 2, device="cpu", shared_core=True) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        [model] = http.get("/v1/models").json()["data"]
        assert model["workers"] == 2 and model["capacity"] == 8  # the core's 8 rows, 4 for each worker
        body = {"model": "shared", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        texts = {http.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(4)}
        assert len(texts) == 1 and texts.pop()


def test_a_worker_of_another_model_is_refused_by_a_shared_core_naming_both(
    shared_core: tuple[Path, subprocess.Popen[bytes]], redis_server: RedisServer, tiny_model: Path
) -> None:
    path, _ = shared_core  # a fake engine's core
    env = {**os.environ, "ORTFLEET_REDIS_URL": redis_server.url, "ORTFLEET_ENGINE_CORE": f"unix:{path}"}
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--model", str(tiny_model), "--name", "other-model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"the engine core at {path}" in done.stderr and "a fake engine" in done.stderr
    assert str(tiny_model) in done.stderr and "--model" in done.stderr


async def test_the_core_host_bench_counts_the_tokens_of_every_row_and_each_sides_cpu() -> None:
    run = await measure(8, 0.5, warmup_s=0.2)
    assert run["rows"] == 8 and run["tokens_per_s"] > 100 and run["steps_per_s"] > 10
    assert run["core_cpu_us_per_row"] > 0 and run["frontend_cpu_us_per_token"] > 0
    assert "rows    8" in text([run])


@pytest.mark.default_model
async def test_on_the_default_model_a_core_killed_mid_stream_leaves_the_uninterrupted_greedy_text(
    redis_server: RedisServer, default_model: Path
) -> None:
    fleet = Fleet(redis_server.url, default_model)
    name = "smollm2-core-kill"
    try:
        fleet.start_gateway()
        worker = fleet.start_worker(name, env={"ORTFLEET_STEP_DELAY_S": "0.03", **IN_A_CORE})
        body = {"model": name, "prompt": "Once upon a time, in a quiet village,", "max_tokens": 120}
        async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=60) as client:
            expected = await wait_done(client, (await submit(client, body))["id"])
            job = await submit(client, body)
            await stream_until_tokens(client, job["id"], 40)
            (core,) = child_pids(worker.pid)
            os.kill(core, signal.SIGKILL)
            done = await wait_done(client, job["id"])
            events = await read_events(client, job["id"])
    finally:
        fleet.stop_all()
    assert done["status"] == "succeeded" and done["attempts"] == 2
    assert 40 <= done["resumed_from"] < 120 and done["resume_exact"] is True
    assert done["output"] == expected["output"] == streamed_text(events)
    assert len(assert_contiguous(events)) == 120
