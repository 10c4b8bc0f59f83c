"""The benches' HTTP client: SSE frames split however the bytes arrive, and a server that closes its
connection after every streamed response (as llama.cpp's llama-server does) served to the end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ortfleet.bench.completions import stream
from ortfleet.bench.http import Connection
from ortfleet.bench.sse import SseDecoder, SseEvent
from tests.closing_server import MODEL
from tests.test_bench import assert_summary, bench, figures


def decoded(*chunks: bytes) -> list[SseEvent]:
    """The events of a body that arrives in these chunks, the i-th at time i."""
    decoder = SseDecoder()
    return [event for i, chunk in enumerate(chunks) for event in decoder.feed(chunk, float(i))]


@pytest.mark.unit
def test_an_event_split_across_chunks_comes_out_whole_stamped_when_its_end_arrived() -> None:
    events = decoded(b'data: {"a"', b": 1}\n", b"\ndata: two\n\nda", b"ta: three\n\n")
    assert [(e.data, e.received) for e in events] == [('{"a": 1}', 2.0), ("two", 2.0), ("three", 3.0)]
    assert all(e.event == "message" and e.id == "" for e in events)


@pytest.mark.unit
def test_crlf_and_cr_line_ends_end_events_even_when_a_crlf_is_split_between_chunks() -> None:
    events = decoded(b"data: a\r\n\r", b"\ndata: b\r\rdata: c\r\n", b"\r\n")
    assert [(e.data, e.received) for e in events] == [("a", 1.0), ("b", 1.0), ("c", 2.0)]


@pytest.mark.unit
def test_an_events_fields_are_read_and_comments_are_no_events() -> None:
    body = b": keep-alive\n\nid: 17-0\nevent: token\ndata:  two spaces\ndata:{}\n\n:\n\nevent: done\n\n"
    events = decoded(body)
    assert [(e.id, e.event, e.data) for e in events] == [
        ("17-0", "token", " two spaces\n{}"),  # one space after the colon is the separator's
        ("", "done", ""),
    ]


@pytest.fixture
def closing_server() -> Iterator[str]:
    """`tests.closing_server` in a process of its own: its root URL."""
    command = [sys.executable, "-m", "tests.closing_server"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            port = server.stdout.readline().removeprefix("listening on ").strip()
            assert port.isdigit(), f"the stand-in server did not start: {port!r}"
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()


async def test_a_connection_the_server_closed_after_a_stream_is_opened_again_for_the_next_request(
    closing_server: str,
) -> None:
    connection = Connection(closing_server)
    try:
        served = [await stream(connection, MODEL, i, 5, prompt="Hi") for i in range(2)]
        accepted = await connection.json("GET", "/connections")
    finally:
        await connection.close()
    assert [(s.tokens, s.text) for s in served] == [(5, " word0 word1 word2 word3 word4")] * 2
    assert accepted == {"accepted": 3}  # each stream's connection closed by the server, then reopened


async def test_a_request_that_crosses_the_servers_close_of_a_kept_connection_goes_again_on_a_new_one(
    closing_server: str,
) -> None:
    connection = Connection(closing_server)
    try:
        models = [await connection.json("GET", "/v1/models") for _ in range(2)]
        accepted = await connection.json("GET", "/connections")
    finally:
        await connection.close()
    assert [[m["id"] for m in answer["data"]] for answer in models] == [[MODEL], [MODEL]]
    assert accepted == {"accepted": 3}  # the second and third requests each went again, on a new one


def test_the_serving_bench_runs_against_a_server_that_closes_its_connection_after_each_stream(
    closing_server: str, tmp_path: Path
) -> None:
    """The server's base is given as OpenAI clients give it, ending in /v1."""
    out = tmp_path / "serving.json"
    done = bench(
        "serving", "--url", f"{closing_server}/v1", "--no-interference", "--concurrency", "1,2",
        "--requests", "4", "--lengths", "4:12", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["served_name"] == MODEL and data["server"] == closing_server
    assert data["engine_alone"] is None and data["interference"] is None
    planned = [request["max_tokens"] for request in data["requests"]]
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level["requests"] == 4 and level["errors"] == 0 and level["tokens_per_s"] > 0
        assert [r["tokens"] for r in level["per_request"]] == planned
        assert_summary(level["ttft_ms"], 4)
        assert_summary(level["itl_ms"], sum(planned) - 4)  # a chunk per token
    assert "server" in done.stdout and "none apply" in done.stdout
