"""A batch's lines: checking the input file, turning a line into a job through the OpenAI request parsing,
and a finished job into a line of the output or error file (OpenAI's format)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from common.error_codes import ErrorCode
from common.jobs.record import JobRecord
from common.wire import JobRequest, JobStatus, Usage
from gateway.batches.state import AnswerFile
from gateway.errors import ApiError, envelope, validation_error
from gateway.openai_api.chat import ChatFormat
from gateway.openai_api.choices import ChoiceResult, finish_reason, job_failure
from gateway.openai_api.completions import CompletionFormat
from gateway.openai_api.params import job_messages, job_request, prompt_texts, reject_unsupported
from gateway.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai_api.serving import served_model
from gateway.openai_api.structured import response_format
from gateway.openai_api.tools import tool_plan
from gateway.request_body import BodyRejected, JsonLimits, load_json
from gateway.state import AppState

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
MAX_REPORTED_ERRORS = 100


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    line: int
    param: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def check_line(raw: str, number: int, endpoint: str, seen: set[str], limits: JsonLimits) -> LineError | None:
    """What is wrong with the shape of line `number` (1-based) of the input file, if anything. A line
    gets the checks a request body gets (nesting depth, number length) with the same codes."""
    try:
        data = load_json(raw.encode("utf-8", "surrogatepass"), limits)
    except BodyRejected as e:
        code = "invalid_json_line" if e.reason == "invalid_json" else e.reason
        detail = e.message.removeprefix("the request body ")
        return LineError(code, f"line {number}: {detail}", number)
    if not isinstance(data, dict):
        return LineError("invalid_request", f"line {number}: must be a JSON object", number)
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            "missing_required_parameter", f"line {number}: custom_id is required", number, "custom_id"
        )
    if custom_id in seen:
        return LineError(
            "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} repeats", number, "custom_id"
        )
    seen.add(custom_id)
    if data.get("method", "POST") != "POST":
        return LineError("invalid_method", f"line {number}: method must be POST", number, "method")
    if data.get("url") != endpoint:
        return LineError(
            "mismatched_url", f"line {number}: url must be the batch's endpoint {endpoint}", number, "url"
        )
    if not isinstance(data.get("body"), dict):
        return LineError("invalid_request", f"line {number}: body must be a JSON object", number, "body")
    return None


def custom_id_of(raw: str) -> str:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # broken, a number past Python's digits, nested too deep
        return ""
    return str(data.get("custom_id", "")) if isinstance(data, dict) else ""


def _no_tool_calls(chat: ChatCompletionRequest) -> None:
    """A batch line's answer is built from its job alone, which does not say what tools it had."""
    plan = tool_plan(chat)
    if plan is not None and plan.calls_allowed:
        field = "functions" if plan.legacy else "tools"
        raise ApiError(
            400,
            f"{field}: tool calls are not supported in batches; send them to /v1/chat/completions",
            param=field,
            code=ErrorCode.unsupported_parameter,
        )


async def line_job(state: AppState, raw: str, endpoint: str) -> JobRequest:
    """The job answering one line, parsed as the endpoint parses its requests; ApiError when it is bad."""
    body: dict[str, Any] = json.loads(raw)["body"]
    try:
        if endpoint == CHAT:
            chat = ChatCompletionRequest.model_validate(body)
            reject_unsupported(chat)
            _no_tool_calls(chat)
            _one_choice(chat.choices_per_prompt)
            served = await served_model(state, chat.model)
            messages = job_messages(chat.messages)
            return job_request(chat, served.name, 0, messages=messages, guided=response_format(chat))
        completion = CompletionRequest.model_validate(body)
        reject_unsupported(completion)
        prompts = prompt_texts(completion.prompt)
        _one_choice(completion.choices_per_prompt * len(prompts))
        served = await served_model(state, completion.model)
        return job_request(completion, served.name, 0, prompt=prompts[0], guided=response_format(completion))
    except ValidationError as e:
        raise validation_error(e, 400) from e


def _one_choice(count: int) -> None:
    if count != 1:
        raise ApiError(400, "n: a batch line asks for one choice (one prompt, n=1)", param="n")


# Characters JSON leaves raw in a string that Python's str.splitlines (and JavaScript before ES2019)
# take for line breaks: escaped, so that every way of splitting a JSONL file finds one line per record.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl(line: dict[str, Any]) -> str:
    """One JSONL line: compact JSON, non-ASCII text as it is but for line breaks, and a newline."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS) + "\n"


def answer_line(
    custom_id: str, job_id: str, status_code: int, body: dict[str, Any], number: int | None = None
) -> str:
    line: dict[str, Any] = {
        "id": f"batch_req_{job_id.removeprefix('job_')}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": job_id, "body": body},
        "error": None,
    }
    if number is not None:
        line["line"] = number
    return jsonl(line)


def refused_line(custom_id: str, number: int, batch_id: str, error: ApiError) -> str:
    """The error-file line of a request refused before it ran, with its line number."""
    line = {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{number}",
        "custom_id": custom_id,
        "response": {
            "status_code": error.status,
            "request_id": None,
            "body": envelope(error.status, f"line {number}: {error.message}", error.param, error.code),
        },
        "error": None,
        "line": number,
    }
    return jsonl(line)


def unanswered_line(custom_id: str, number: int, batch_id: str, code: str, message: str) -> str:
    """The error-file line of a request the batch never ran (expired, cancelled)."""
    line = {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{number}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
        "line": number,
    }
    return jsonl(line)


def finished_line(
    custom_id: str, number: int, batch_id: str, endpoint: str, job_id: str, record: JobRecord | None
) -> tuple[AnswerFile, str]:
    """('output' or 'error', the file line) for the finished job `job_id` of line `number`; a job whose
    record is gone failed."""
    status = record.status if record is not None else JobStatus.failed
    if record is not None and status is JobStatus.succeeded:
        usage = record.usage or Usage()
        reason = record.finish_reason.value if record.finish_reason else None
        text, closed = record.output or "", record.closed_early
        result = ChoiceResult(text, finish_reason(reason), usage, closed_early=closed)
        created = int(record.created_at)
        model = record.requested_model
        form: ChatFormat | CompletionFormat
        if endpoint == CHAT:
            form = ChatFormat(f"chatcmpl-{job_id}", created, model, 1)
        else:
            form = CompletionFormat(f"cmpl-{job_id}", created, model)
        body = form.complete([result], usage).model_dump(mode="json")
        return "output", answer_line(custom_id, job_id, 200, body)
    if status is JobStatus.cancelled:
        return "error", unanswered_line(
            custom_id, number, batch_id, "batch_cancelled", "cancelled with the batch"
        )
    message = "the job vanished" if record is None else record.error or "the request failed"
    code = record.error_code if record is not None else None
    error = job_failure(job_id, message, code, "messages" if endpoint == CHAT else "prompt")  # as HTTP
    body = envelope(error.status, f"line {number}: {error.message}", error.param, error.code)
    return "error", answer_line(custom_id, job_id, error.status, body, number)
