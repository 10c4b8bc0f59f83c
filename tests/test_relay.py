"""The gateway's stream relay: many open streams on a few Redis connections, slow readers apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from httpx_sse import aconnect_sse
from redis.asyncio import Redis

from common.gateway_settings import GatewaySettings
from common.jobs.queue import JobQueue
from common.jobs.reads import notice_streams, stage_jobs
from common.jobs.record import JobRecord
from common.jobs.writes import StepResult, StepWrite
from common.redis_client import gateway_client_name
from common.stores import Store
from common.wire import JobStatus
from gateway.app import build_app
from gateway.http_protocol import guarded_protocol
from gateway.state import AppState
from gateway.streaming.follower import Follower
from gateway.streaming.ids import KeyedEntry
from gateway.streaming.relay import StreamRelay
from gateway.streaming.stream_reader import SWEEP_KEYS_PER_READ
from ortfleet.bench.capacity import xread_calls
from ortfleet.fleet.processes import free_port
from tests.conftest import Fleet, RedisServer, keys
from tests.jobs_client import read_events
from tests.redis_events import add_entry
from tests.test_observability import value
from tests.waiting import until

STREAMS = 300
POOL, RELAY = 4, 2  # the gateway's Redis connections: request pool, relay readers
SUBSCRIPTION = 1  # the relay's subscription to the stream notices


async def create_running_jobs(redis: Redis, prefix: str, count: int) -> list[str]:
    """Running jobs as a worker would have them, each with its status event: no model needed."""
    job_ids = [f"{prefix}_{i:04d}" for i in range(count)]
    now = time.time()
    running = [
        JobRecord(id=i, model="relay", status=JobStatus.running, created_at=now, attempts=1) for i in job_ids
    ]
    await stage_jobs(redis, keys, running)
    return job_ids


async def gateway_connections(redis: Redis, pid: int) -> int:
    clients = await redis.client_list()
    return sum(1 for client in clients if client["name"] == gateway_client_name(pid))


@pytest.fixture
def gateways(redis_server: RedisServer) -> Iterator[Fleet]:
    """Gateways alone (no worker, no model)."""
    fleet = Fleet(redis_server.url, Path("no-model"))
    yield fleet
    fleet.stop_all()


async def test_hundreds_of_open_streams_hold_no_more_redis_connections_than_the_gateways_bound(
    gateways: Fleet, redis: Redis
) -> None:
    gateway, url = gateways.start_gateway(
        env={"ORTFLEET_REDIS_MAX_CONNECTIONS": str(POOL), "ORTFLEET_RELAY_CONNECTIONS": str(RELAY)}
    )
    job_ids = await create_running_jobs(redis, "many", STREAMS)
    opened = 0
    all_open = asyncio.Event()

    async def on_open() -> None:
        nonlocal opened
        opened += 1
        if opened == STREAMS:
            all_open.set()

    limits = httpx.Limits(max_connections=STREAMS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def follow(job_id: str) -> list[str]:
            connected = asyncio.Event()
            reader = asyncio.create_task(read_events(client, job_id, connected=connected))
            await connected.wait()
            await on_open()
            return [event.event for event in await reader]

        readers = [asyncio.create_task(follow(job_id)) for job_id in job_ids]
        await asyncio.wait_for(all_open.wait(), 120)
        assert await gateway_connections(redis, gateway.process.pid) <= POOL + RELAY + SUBSCRIPTION
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xadd(keys.events(job_id), {"type": "token", "text": "hi", "ids": "1", "index": "0"})
                pipe.xadd(keys.events(job_id), {"type": "done", "status": "succeeded"})
            notice_streams(pipe, keys, [keys.events(job_id) for job_id in job_ids])
            await pipe.execute()
        streams = await asyncio.wait_for(asyncio.gather(*readers), 120)
    assert streams == [["status", "token", "done"]] * STREAMS
    assert 1 <= await gateway_connections(redis, gateway.process.pid) <= POOL + RELAY + SUBSCRIPTION


@contextlib.asynccontextmanager
async def in_process_gateway(redis_url: str, protocol: str) -> AsyncIterator[tuple[str, AppState]]:
    """The gateway on uvicorn in this event loop, so its tasks can be counted: behind its own HTTP
    protocol ("gateway"), as `python -m gateway` serves it, or behind uvicorn's own ("uvicorn")."""
    app = build_app(GatewaySettings(redis_url=redis_url))
    http = guarded_protocol(16_384, 10, 30, lambda reason: None) if protocol == "gateway" else "httptools"
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:  # uvicorn has no event for it
        assert not serving.done(), "the gateway did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app.state.ortfleet
    finally:
        server.should_exit = True
        await serving


def tasks_started(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {task for task in asyncio.all_tasks() - before if task is not current}


@pytest.mark.parametrize(("protocol", "tasks_per_stream"), [("gateway", 1), ("uvicorn", 2)])
async def test_clients_that_leave_their_streams_and_long_polls_end_them_at_once(
    protocol: str, tasks_per_stream: int, redis_server: RedisServer, redis: Redis
) -> None:
    """Behind the gateway's protocol an open stream is one task, told by a callback that its client left;
    behind another server Starlette's second task per stream, waiting in receive(), does it."""
    warm, *job_ids = await create_running_jobs(redis, f"leaving_{protocol}", 11)
    gateway = in_process_gateway(redis_server.url, protocol)
    async with gateway as (url, state), httpx.AsyncClient(base_url=url) as client:

        async def open_streams(streams: contextlib.AsyncExitStack, ids: list[str]) -> set[asyncio.Task[Any]]:
            """The gateway's tasks that started while the streams opened."""
            before = asyncio.all_tasks()
            for job_id in ids:
                opened = aconnect_sse(client, "GET", f"/v1/jobs/{job_id}/events")
                events = (await streams.enter_async_context(opened)).aiter_sse()
                streams.push_async_callback(events.aclose)  # held open until the stack closes
                assert (await anext(events)).event == "status"
            return tasks_started(before)

        async with contextlib.AsyncExitStack() as streams:  # the relay's own tasks start with a first stream
            warming = await open_streams(streams, [warm])
        await asyncio.wait(warming, timeout=10)
        async with contextlib.AsyncExitStack() as streams:
            serving = await open_streams(streams, job_ids)
            assert sum(state.streams.open.values()) == len(job_ids)
        # The clients left without a word: each stream ends, with nothing to write to it.
        _, pending = await asyncio.wait(serving, timeout=10)
        assert not pending and not state.streams.open

        before = asyncio.all_tasks()
        with pytest.raises(httpx.ReadTimeout):  # the client leaves a 30 s long-poll after 0.5 s
            await client.get(f"/v1/jobs/{job_ids[0]}", params={"wait": 30}, timeout=0.5)
        _, pending = await asyncio.wait(tasks_started(before), timeout=10)
        assert not pending and not state.streams.open
    assert len(serving) == tasks_per_stream * len(job_ids)


@pytest.fixture
async def relay(redis_server: RedisServer) -> AsyncIterator[StreamRelay]:
    streams = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=4)
    await streams.start()
    yield streams
    await streams.close()


async def read_until(follower: Follower, count: int) -> list[KeyedEntry]:
    entries: list[KeyedEntry] = []
    while len(entries) < count:
        batch = await follower.next(10)
        assert batch, f"nothing within 10 s after {len(entries)} entries"
        entries += batch
    return entries


async def test_a_client_that_stops_reading_holds_up_no_one_and_then_reads_every_event_from_redis(
    gateways: Fleet, redis: Redis
) -> None:
    """The gateway writes a job's events straight to each client's connection; once a connection backs
    up (its client stopped reading) it stops writing to it, counts the pause, and reads on from Redis
    when the client reads again. A client of the same job reading meanwhile gets every event at once."""
    _, url = gateways.start_gateway()
    (job_id,) = await create_running_jobs(redis, "stalled_reader", 1)
    stream, count = keys.events(job_id), 3000  # 24 MB of text: more than the socket buffers hold
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as stalled_client,
        httpx.AsyncClient(base_url=url, timeout=60) as reading_client,
        aconnect_sse(stalled_client, "GET", f"/v1/jobs/{job_id}/events") as stalled,
    ):
        stalled_events = stalled.aiter_sse()
        assert (await anext(stalled_events)).event == "status"
        connected = asyncio.Event()
        reading = asyncio.create_task(read_events(reading_client, job_id, connected=connected))
        await asyncio.wait_for(connected.wait(), 30)
        for first in range(0, count, 250):
            async with redis.pipeline(transaction=False) as pipe:
                for index in range(first, first + 250):
                    pipe.xadd(stream, {"type": "token", "text": "x" * 8192, "ids": "1", "index": str(index)})
                notice_streams(pipe, keys, [stream])
                await pipe.execute()
        await add_entry(redis, stream, {"type": "done", "status": "succeeded"})
        read = await asyncio.wait_for(reading, 60)  # while the other client reads nothing
        assert [e.data["index"] for e in read if e.event == "token"] == list(range(count))
        metrics = (await reading_client.get("/metrics")).text
        assert (value(metrics, "ortfleet_sse_client_pauses_total") or 0) >= 1
        rest = []
        async for sse in stalled_events:
            rest.append(sse)
            if sse.event == "done":
                break
    assert [json.loads(e.data)["index"] for e in rest if e.event == "token"] == list(range(count))
    assert rest[-1].event == "done"


async def test_a_quiet_job_stream_gets_a_keep_alive_each_interval_and_then_its_events(
    gateways: Fleet, redis: Redis
) -> None:
    _, url = gateways.start_gateway(env={"ORTFLEET_SSE_KEEPALIVE_S": "0.3"})
    (job_id,) = await create_running_jobs(redis, "quiet", 1)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("GET", f"/v1/jobs/{job_id}/events") as reply,
    ):
        lines = reply.aiter_lines()

        async def arrival(wanted: str, *passing: str) -> float:
            """When the line `wanted` arrives; before it, only blank, id and data lines and `passing`."""
            async for line in lines:
                if line == wanted:
                    return time.monotonic()
                assert line in passing or line == "" or line.startswith(("id: ", "data: ")), line
            raise AssertionError(f"the stream ended before {wanted!r}")

        opened = await asyncio.wait_for(arrival("event: status"), 10)
        alive = [await asyncio.wait_for(arrival(": keep-alive"), 10) for _ in range(3)]
        gaps = [later - earlier for earlier, later in zip([opened, *alive], alive, strict=False)]
        assert all(gap >= 0.25 for gap in gaps), gaps  # one each interval of silence, not more often
        await add_entry(redis, keys.events(job_id), {"type": "token", "text": "hi", "ids": "1", "index": "0"})
        await add_entry(redis, keys.events(job_id), {"type": "done", "status": "succeeded"})
        await asyncio.wait_for(arrival("event: token", ": keep-alive"), 10)
        await asyncio.wait_for(arrival("event: done", ": keep-alive"), 10)


async def test_a_slow_reader_holds_up_no_one_and_later_reads_every_entry_from_redis(
    relay: StreamRelay, redis: Redis
) -> None:
    stream = keys.events("relay_slow")
    await redis.delete(stream)
    written = [await add_entry(redis, stream, {"n": str(n)}) for n in range(40)]
    async with relay.follow({stream: "0-0"}) as slow, relay.follow({stream: "0-0"}) as fast:
        fast_entries = await read_until(fast, 40)  # the slow one reads nothing meanwhile (buffer: 4)
        assert [entry_id for _key, entry_id, _fields in fast_entries] == written
        slow_entries = await read_until(slow, 40)
    assert [entry_id for _key, entry_id, _fields in slow_entries] == written  # no gap, no duplicate


async def test_a_reader_joining_while_the_relay_waits_gets_its_backlog_at_once(
    relay: StreamRelay, redis: Redis
) -> None:
    idle, busy = keys.events("relay_idle"), keys.events("relay_backlog")
    await redis.delete(idle, busy)
    await add_entry(redis, busy, {"n": "0"})
    async with relay.follow({idle: "0-0"}) as waiting:
        assert await waiting.next(0.2) == []  # the relay now waits for a notice
        started = time.monotonic()
        async with relay.follow({busy: "0-0"}) as joining:
            entries = await joining.next(10)
        assert [fields for _key, _id, fields in entries] == [{"n": "0"}]
        assert time.monotonic() - started < 1.0


async def test_readers_resuming_from_different_entries_each_get_only_what_follows_theirs(
    relay: StreamRelay, redis: Redis
) -> None:
    stream = keys.events("relay_resume")
    await redis.delete(stream)
    written = [await add_entry(redis, stream, {"n": str(n)}) for n in range(3)]
    async with relay.follow({stream: written[1]}) as late, relay.follow({stream: "0-0"}) as early:
        assert [entry_id for _k, entry_id, _f in await read_until(late, 1)] == written[2:]
        assert [entry_id for _k, entry_id, _f in await read_until(early, 3)] == written
        newer = await add_entry(redis, stream, {"n": "3"})
        assert [entry_id for _k, entry_id, _f in await read_until(late, 1)] == [newer]
        assert [entry_id for _k, entry_id, _f in await read_until(early, 1)] == [newer]


async def test_readers_joining_a_busy_stream_from_its_start_each_read_every_entry_in_order(
    relay: StreamRelay, redis: Redis
) -> None:
    stream = keys.events("relay_busy")
    await redis.delete(stream)
    written: list[str] = []

    async def write() -> None:
        for n in range(300):
            written.append(await add_entry(redis, stream, {"n": str(n)}))

    async def join_and_read() -> list[str]:
        async with relay.follow({stream: "0-0"}) as follower:
            return [entry_id for _k, entry_id, _f in await read_until(follower, 300)]

    writer = asyncio.create_task(write())
    readers = []
    while not writer.done():  # readers join from the start while entries keep coming
        readers.append(asyncio.create_task(join_and_read()))
        await asyncio.sleep(0.002)
    await writer
    for reader in await asyncio.gather(*readers):
        assert reader == written


def tokens(*texts: str) -> list[dict[str, str]]:
    return [{"type": "token", "text": text, "ids": "1", "index": str(n)} for n, text in enumerate(texts)]


async def job_written_by_steps(redis: Redis, name: str) -> tuple[str, str, JobQueue]:
    """A running job (its first attempt), its stream, and the queue whose step writes add to it."""
    (job_id,) = await create_running_jobs(redis, name, 1)
    return job_id, keys.events(job_id), JobQueue(redis, 3600, keys)


@contextlib.asynccontextmanager
async def unheard_entry(
    relay: StreamRelay, redis: Redis, name: str
) -> AsyncIterator[tuple[Follower, JobQueue, str, str]]:
    """A follower that has read a running job's stream, then an entry added to it of which the relay
    heard nothing (as while it resubscribes): the follower, the job's queue, its id and the entry's."""
    job_id, stream, queue = await job_written_by_steps(redis, name)
    async with relay.follow({stream: "0-0"}) as follower:
        await read_until(follower, 1)
        yield follower, queue, job_id, await redis.xadd(stream, {"type": "status", "status": "running"})


@pytest.fixture
async def quiet_relay(redis_server: RedisServer) -> AsyncIterator[StreamRelay]:
    """A relay whose sweep never comes within a test: every read it makes is one a notice or a join asked
    for."""
    streams = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=16, sweep_s=600)
    await streams.start()
    yield streams
    await streams.close()


async def test_a_step_write_s_notice_brings_its_entries_to_followers_that_have_the_rest_without_a_read(
    quiet_relay: StreamRelay, redis: Redis
) -> None:
    job_id, stream, queue = await job_written_by_steps(redis, "carried")
    notices = redis.pubsub()
    await notices.subscribe(keys.stream_notices)
    try:
        async with (
            quiet_relay.follow({stream: "0-0"}) as first,
            quiet_relay.follow({stream: "0-0"}) as second,
        ):
            for follower in (first, second):  # the job's status entry, read when they joined
                assert [fields["type"] for _k, _id, fields in await read_until(follower, 1)] == ["status"]
            reads = await xread_calls(redis)
            written = tokens("Hello", ",", " world")
            assert await queue.publish_step([StepWrite(job_id, 1, written, {})]) == [StepResult.written]
            in_redis = (await redis.xrange(stream))[1:]
            for follower in (first, second):
                entries = await read_until(follower, 3)
                assert [(entry_id, fields) for _k, entry_id, fields in entries] == in_redis
                assert [fields for _k, _id, fields in entries] == written
            assert await xread_calls(redis) == reads  # nothing read back from Redis

        # The notice still names the stream on its first line, for a relay that reads the keys alone.
        async def step_notice() -> str:
            while True:  # past the subscription's confirmation and the job's staging
                message = await notices.get_message(ignore_subscribe_messages=True, timeout=5)
                if message is not None and "\n" in message["data"]:
                    return str(message["data"])

        notice = await asyncio.wait_for(step_notice(), 10)
        assert notice.split("\n")[0].split() == [stream]
    finally:
        await notices.aclose()


async def test_a_follower_that_lacks_entries_before_a_notice_s_reads_them_first_in_order(
    quiet_relay: StreamRelay, redis: Redis
) -> None:
    async with unheard_entry(quiet_relay, redis, "carried_gap") as (follower, queue, job_id, missed):
        stream = keys.events(job_id)
        await queue.publish_step([StepWrite(job_id, 1, tokens("a", "b"), {})])
        entries = await read_until(follower, 3)
        assert [entry_id for _k, entry_id, _f in entries] == [
            missed,
            *(entry_id for entry_id, _f in (await redis.xrange(stream))[2:]),
        ]
        assert [fields["type"] for _k, _id, fields in entries] == ["status", "token", "token"]
        assert await follower.next(0.2) == []  # each entry once


async def test_entries_a_writer_adds_without_a_notice_still_arrive_with_the_next_sweep(
    redis_server: RedisServer, redis: Redis
) -> None:
    streams = StreamRelay(Store(redis_server.url, keys), connections=1, buffer=4, sweep_s=0.5)
    await streams.start()
    stream = keys.events("relay_unnoticed")
    await redis.delete(stream)
    try:
        async with streams.follow({stream: "0-0"}) as follower:
            assert await follower.next(0.2) == []
            written = await redis.xadd(stream, {"n": "0"})  # no notice: as a writer of another version
            entries = await follower.next(5)
            assert [entry_id for _k, entry_id, _f in entries] == [written]
    finally:
        await streams.close()


async def test_a_sweep_of_thousands_of_streams_is_read_beside_notified_ones_not_before_them(
    redis_server: RedisServer,
) -> None:
    streams = StreamRelay(
        Store(redis_server.url, keys), connections=1, buffer=4, max_keys=1000
    )  # not started: no reads
    followed = [keys.events(f"relay_sweep_{n}") for n in range(3000)]
    async with contextlib.AsyncExitStack() as stack:
        for stream in followed:
            await stack.enter_async_context(streams.follow({stream: "0-0"}))
        reader = streams._readers[0]
        while reader._next_keys():  # the first reads of the streams just joined
            pass
        reader.all_due()  # a sweep: every stream again
        reader.due(followed[-1])  # and a notice for the last one
        first = reader._next_keys()
        assert first[0] == followed[-1]
        assert len(first) == 1 + SWEEP_KEYS_PER_READ  # the notified stream, and a share of the sweep
        swept = set(first[1:])
        while batch := reader._next_keys():  # nothing else due: the sweep goes on a full read at a time
            assert len(batch) <= 1000
            swept.update(batch)
        # Every stream read again, the notified one once: its read counted for the sweep too.
        assert followed[-1] not in swept and swept | {followed[-1]} == set(followed)
    await streams.close()


async def test_a_relay_drops_reads_a_stalled_redis_leaves_unanswered_and_relays_again_once_it_answers(
    own_redis: RedisServer,
) -> None:
    """The relay's commands carry no timeout of their own: its sweep finds the overdue reply."""
    redis = Redis.from_url(own_redis.url, decode_responses=True)
    streams = StreamRelay(
        Store(own_redis.url, keys), connections=1, buffer=16, sweep_s=0.2, socket_timeout_s=0.5
    )
    stream = keys.events("relay_stalled")
    await streams.start()
    try:
        async with streams.follow({stream: "0-0"}) as follower:
            first = await add_entry(redis, stream, {"n": "0"})
            assert [entry_id for _k, entry_id, _f in await follower.next(5)] == [first]
            own_redis.process.send_signal(19)  # SIGSTOP: Redis keeps its sockets open and answers nothing
            try:  # the overdue read is dropped: the relay says Redis is unreachable
                await until(lambda: streams.unreachable_for() is not None, "Redis reported unreachable", 10)
            finally:
                own_redis.process.send_signal(18)  # SIGCONT
            second = await add_entry(redis, stream, {"n": "1"})
            assert [entry_id for _k, entry_id, _f in await follower.next(10)] == [second]
            await until(lambda: streams.unreachable_for() is None, "Redis reported reachable again", 10)
    finally:
        await streams.close()
        await redis.aclose()


async def test_a_notice_whose_entries_cannot_be_read_has_its_streams_read_and_later_notices_still_heard(
    quiet_relay: StreamRelay, redis: Redis
) -> None:
    async with unheard_entry(quiet_relay, redis, "carried_garbled") as (follower, queue, job_id, added):
        await redis.publish(keys.stream_notices, f"{keys.events(job_id)}\n[[not json")
        assert [entry_id for _k, entry_id, _f in await read_until(follower, 1)] == [added]
        await queue.publish_step([StepWrite(job_id, 1, tokens("next"), {})])
        assert [fields["text"] for _k, _id, fields in await read_until(follower, 1)] == ["next"]
