"""A job stream's ids and the bytes of its events: one parser and one framing, shared by the job
routes, the OpenAI streams and Responses."""

from __future__ import annotations

import pytest

from gateway.openai_api.streaming import chunk_frame
from gateway.streaming.ids import parse_id, valid_entry_id
from gateway.streaming.sse import KEEPALIVE, frame, frames, json_bytes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["0-0", "1-0", "1732600000000-12", f"{2**64 - 1}-{2**64 - 1}"])
def test_a_stream_id_a_client_sends_back_is_accepted_when_redis_could_have_made_it(text: str) -> None:
    assert valid_entry_id(text)


NOT_IDS = ["", "1", "1-", "-1", "1-2-3", " 1-2", "1-2 ", "a-1", "1-²", "\u0661-1", f"{2**64}-0", f"0-{2**64}"]


@pytest.mark.parametrize("text", NOT_IDS)
def test_a_stream_id_redis_could_not_have_made_is_refused(text: str) -> None:
    assert not valid_entry_id(text)


def test_stream_ids_compare_as_redis_orders_them_not_as_text() -> None:
    assert parse_id("10-0") > parse_id("9-5")
    assert parse_id("9-10") > parse_id("9-9")
    assert parse_id("1732600000000-3") == (1732600000000, 3)
    assert parse_id("7") == (7, 0)


def test_a_job_entry_is_one_event_with_its_id_its_type_and_its_fields_as_json() -> None:
    entries = [
        ("1-0", {"type": "status", "status": "running"}),
        ("1-1", {"type": "token", "text": "héllo", "index": "0", "attempt": "1"}),
        ("1-2", {"note": "no type"}),
    ]
    assert frames(entries) == (
        b'id: 1-0\nevent: status\ndata: {"type":"status","status":"running"}\n\n'
        b'id: 1-1\nevent: token\ndata: {"type":"token","text":"h\xc3\xa9llo","index":0,"attempt":1}\n\n'
        b'id: 1-2\nevent: message\ndata: {"note":"no type"}\n\n'
    )


def test_an_event_without_an_id_or_a_type_is_a_data_line_alone() -> None:
    assert frame(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert frame(b"{}", "response.created") == b"event: response.created\ndata: {}\n\n"
    assert KEEPALIVE == b": keep-alive\n\n"


def test_text_json_cannot_encode_is_escaped_rather_than_failing_the_stream() -> None:
    assert json_bytes({"text": "a\ud800b"}) == b'{"text":"a\\ud800b"}'
    error = {"error": {"message": "bad \ud800"}}
    assert chunk_frame(error) == b'data: {"error":{"message":"bad \\ud800"}}\n\n'


def test_an_openai_chunk_is_a_data_line_of_compact_json_with_text_as_it_is() -> None:
    assert chunk_frame({"error": {"message": "trop long ✓", "code": None}}) == (
        'data: {"error":{"message":"trop long ✓","code":null}}\n\n'.encode()
    )
