"""From OpenAI's parameters to ortfleet job requests, one per choice."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from common.error_codes import ErrorCode
from common.guidance import ResponseFormat
from common.wire import ChatMessage, JobRequest
from gateway.errors import ApiError, validation_error
from gateway.openai_api.content import parts_text
from gateway.openai_api.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessageIn,
    GenerationParams,
    OpenAIRequest,
)
from gateway.openai_api.tool_results import check_tool_results
from gateway.openai_api.tools import Conversation, assistant_calls

_SEEDS = 2**63  # OpenAI's signed 64-bit seeds into the job's range, each keeping its engine seed (mod 2**31)


def reject_unsupported(body: OpenAIRequest) -> None:
    """400 naming the parameters set to something ortfleet cannot honour (or set without what they need):
    chat, text completions and Responses alike."""
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    names = body.unsupported_parameters()
    if names:
        them = "it" if len(names) == 1 else "them"
        raise ApiError(
            400,
            f"{', '.join(names)}: not supported by ortfleet; leave {them} unset",
            param=names[0],
            code=ErrorCode.unsupported_parameter,
        )


def job_request(
    body: GenerationParams,
    model: str,
    choice: int,
    *,
    prompt: str | None = None,
    messages: list[ChatMessage] | None = None,
    guided: ResponseFormat | None,
) -> JobRequest:
    """The job of one choice; choice k of a seeded request samples with seed + k, so choices differ.
    `guided`: the job's output format, as the request's structured-output fields and tools make it."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    fields: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "messages": messages,
        "max_tokens": body.generated_limit(),
        "temperature": 1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": None if body.seed is None else (body.seed + choice) % _SEEDS,
        "stop": stop or None,
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "repetition_penalty": body.repetition_penalty,
        "stop_token_ids": body.stop_token_ids,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "response_format": guided,
        "close_early": body.close_early,
        "priority": body.priority,
        "cache_salt": body.cache_salt,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "logit_bias": body.logit_bias,
        "logprobs": body.job_logprobs(),
        "prompt_logprobs": body.job_prompt_logprobs(),
    }
    try:
        return JobRequest.model_validate({key: value for key, value in fields.items() if value is not None})
    except ValidationError as e:
        error = validation_error(e, 400)
        named = body.limit_name()
        if error.param == "max_tokens" and named != "max_tokens":
            error = ApiError(400, named + error.message.removeprefix("max_tokens"), param=named)
        raise error from e


def job_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """Chat messages as jobs take them: text only; `developer` is the newer name of `system`. Calls an
    assistant made and the tools' results are written in the tool prompt format (see tools.py)."""
    texts = [_text(message, i) for i, message in enumerate(messages)]  # before how they answer each other
    check_tool_results(messages)
    conversation = Conversation()
    for i, (message, content) in enumerate(zip(messages, texts, strict=True)):
        if message.role in ("tool", "function"):
            conversation.add_result(content)
            continue
        role = "system" if message.role == "developer" else message.role
        if role == "assistant":
            content = "\n".join([*([content] if content else []), *assistant_calls(message, i)])
        conversation.add(role, content)
    return conversation.messages()


def _text(message: ChatMessageIn, i: int) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise ApiError(400, f"messages.{i}.content: required", param=f"messages.{i}.content")
        return ""
    if isinstance(content, str):
        return content
    return parts_text(content, f"messages.{i}.content", ("text",))


def prompt_texts(prompt: str | list[Any]) -> list[str]:
    """A completion's prompts: a string, or a list of strings (each its own choice)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    if not all(isinstance(p, str) for p in prompt):
        raise ApiError(
            400,
            "prompt: token-id prompts are not supported by ortfleet; send text",
            param="prompt",
            code=ErrorCode.unsupported_value,
        )
    return list(prompt)


def check_choice_count(count: int) -> None:
    if count > MAX_CHOICES:
        raise ApiError(
            400,
            f"n: {count} choices requested (prompts times n); at most {MAX_CHOICES} per request",
            param="n",
        )
