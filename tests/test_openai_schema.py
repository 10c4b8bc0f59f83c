"""The suite's check of every answer against OpenAI's OpenAPI document (tests/openai_schema.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from gateway.openai_api.choices import finish_reason
from tests.openai_schema import OpenAISchema

pytestmark = pytest.mark.unit

SCHEMA = OpenAISchema()


def chat_completion(**message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def test_the_copy_of_openais_document_says_its_version_and_source() -> None:
    info = SCHEMA.document["info"]
    assert info["version"] == "2.3.0"
    assert info["x-source"].startswith("https://github.com/openai/openai-openapi/blob/")


def test_a_chat_message_without_refusal_is_named_by_its_json_pointer() -> None:
    assert SCHEMA.mismatch(
        "CreateChatCompletionResponse", chat_completion(role="assistant", content="hi")
    ) == ("CreateChatCompletionResponse at /choices/0/message: 'refusal' is a required property")
    fixed = chat_completion(role="assistant", content="hi", refusal=None)
    assert SCHEMA.mismatch("CreateChatCompletionResponse", fixed) is None


def test_vllms_abort_is_not_one_of_openais_finish_reasons() -> None:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}],
    }
    assert SCHEMA.mismatch("CreateChatCompletionStreamResponse", chunk) is None  # nullable, as OpenAPI 3.0
    chunk["choices"][0]["finish_reason"] = "abort"
    problem = SCHEMA.mismatch("CreateChatCompletionStreamResponse", chunk)
    assert problem is not None and problem.startswith(
        "CreateChatCompletionStreamResponse at /choices/0/finish_reason"
    )


def test_a_job_cancelled_through_the_job_api_finishes_with_length_as_openai_has_no_abort() -> None:
    assert finish_reason("cancelled") == "length"
    assert (finish_reason("stop"), finish_reason("length")) == ("stop", "length")


def test_a_stream_event_is_checked_against_the_event_its_type_names() -> None:
    event = {
        "type": "response.output_text.delta",
        "sequence_number": 1,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "hi",
    }
    assert SCHEMA.mismatch("ResponseStreamEvent", event) == (
        "ResponseTextDeltaEvent at /: 'logprobs' is a required property"
    )
    assert SCHEMA.mismatch("ResponseStreamEvent", {**event, "logprobs": []}) is None


def test_only_openais_routes_are_checked() -> None:
    assert SCHEMA.route("/v1/chat/completions") == "/chat/completions"
    assert SCHEMA.route("/v1/responses/resp_1/input_items") == "/responses/{response_id}/input_items"
    assert SCHEMA.route("/v1/jobs/job_1") is None
    assert SCHEMA.answer_schema("GET", "/models", 200, "application/json") == "ListModelsResponse"
    assert SCHEMA.answer_schema("POST", "/responses", 404, "application/json") == "ErrorResponse"


class _WrongModels(BaseHTTPRequestHandler):
    """Answers GET /v1/models with a list whose model lacks `owned_by`, and streams one bad chunk."""

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 1}]})
        self._send("application/json", body.encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": "none"}
        self._send("text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    def _send(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wrong_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WrongModels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_answers_read_by_httpx_and_by_the_sdk_are_checked(wrong_server: str) -> None:
    from tests.conftest import SCHEMA_MISMATCHES

    with httpx.Client(base_url=wrong_server) as http:
        http.get("/v1/models")
        http.get("/v1/jobs")  # not OpenAI's: not checked
    with openai.OpenAI(base_url=wrong_server + "/v1", api_key="unused", max_retries=0) as sdk:
        sdk.models.list()
        for _ in sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            pass
    seen = list(SCHEMA_MISMATCHES)
    SCHEMA_MISMATCHES.clear()  # the answers were wrong on purpose: this test passes
    assert [line.split("\n")[0] for line in seen] == [
        "GET /v1/models 200: ListModelsResponse at /data/0: 'owned_by' is a required property",
        "GET /v1/models 200: ListModelsResponse at /data/0: 'owned_by' is a required property",
        "POST /v1/chat/completions 200: CreateChatCompletionStreamResponse at /choices: "
        "'none' is not of type 'array'",
    ]


def test_only_an_empty_page_of_a_list_may_have_null_first_and_last_ids() -> None:
    empty = {"object": "list", "data": [], "has_more": False, "first_id": None, "last_id": None}
    assert SCHEMA.mismatch("ListFilesResponse", empty) is None
    batch = {"id": "batch_1", "object": "batch", "endpoint": "/v1/completions", "input_file_id": "file-1"}
    page = {**empty, "data": [batch]}
    problem = SCHEMA.mismatch("ListBatchesResponse", page)
    assert problem is not None and "_id: None is not of type 'string'" in problem
