"""A response's input items: checked and stored as OpenAI lists them (each with an `id`), and turned into
the chat messages of its job.

Items: messages (`role` `user`, `system`, `developer` or `assistant`; text content), the model's
`function_call`s and the client's `function_call_output`s. A response that continues another
(`previous_response_id`) is given that one's input items and output items before its own, and keeps
them all as its input items.
"""

from __future__ import annotations

from typing import Any

from common.error_codes import ErrorCode
from common.wire import ChatMessage
from gateway.errors import ApiError
from gateway.openai_api.content import parts_text
from gateway.openai_api.tools import Conversation, call_text

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_KINDS = ("message", "function_call", "function_call_output")


def normalized_input(raw: str | list[Any], hex_id: str) -> list[dict[str, Any]]:
    """The request's `input` as stored input items; 400 naming the field of a malformed one."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    elif not raw:
        raise ApiError(400, "input: must not be empty", param="input")
    return [_item(item, i, f"{hex_id}_in{i}") for i, item in enumerate(raw)]


def _item(item: Any, i: int, suffix: str) -> dict[str, Any]:
    where = f"input.{i}"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where}: must be an object", param=where)
    kind = item.get("type", "message")
    if kind not in _KINDS:
        raise ApiError(
            400,
            f"{where}.type: items of type {kind!r} are not supported by ortfleet (messages, function_call "
            "and function_call_output)",
            param=f"{where}.type",
            code=ErrorCode.unsupported_value,
        )
    if kind == "function_call":
        call_id, name = _string(item, "call_id", where), _string(item, "name", where)
        arguments = item.get("arguments")
        if not isinstance(arguments, str):
            raise ApiError(400, f"{where}.arguments: must be a JSON string", param=f"{where}.arguments")
        call_text(name, arguments, f"{where}.arguments")  # 400 unless JSON
        return _stored(
            item, kind, f"fc_{suffix}", call_id=call_id, name=name, arguments=arguments, status="completed"
        )
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        output = _output(item.get("output"), f"{where}.output")
        return _stored(item, kind, f"fco_{suffix}", call_id=call_id, output=output, status="completed")
    role = _ROLES.get(str(item.get("role")))
    if role is None:
        raise ApiError(
            400, f"{where}.role: {item.get('role')!r} is not one of {sorted(_ROLES)}", param=f"{where}.role"
        )
    text = _content(item.get("content"), where)
    assistant = role == "assistant"
    content = (
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if assistant
        else {"type": "input_text", "text": text}
    )
    return _stored(
        item, "message", f"msg_{suffix}", role=item.get("role"), status="completed", content=[content]
    )


def _stored(item: dict[str, Any], kind: str, new_id: str, **fields: Any) -> dict[str, Any]:
    """The item as stored: its type, its own `id` (`new_id` when it has none), then `fields`."""
    given = item.get("id")
    return {"type": kind, "id": given if isinstance(given, str) else new_id, **fields}


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where}.{name}: required (a string)", param=f"{where}.{name}")
    return value


def _output(output: Any, where: str) -> str:
    """A call's output: a string, or a list of text parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content(output, where.rpartition(".")[0], field="output")
    raise ApiError(400, f"{where}: required (a string or a list of text parts)", param=where)


def _content(content: Any, where: str, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.{field}: a string or a list of text parts", param=f"{where}.{field}")
    return parts_text(content, f"{where}.{field}", _TEXT_PARTS)


def item_text(item: dict[str, Any]) -> str:
    return "\n".join(part.get("text", "") for part in item.get("content", []))


def conversation(
    instructions: str | None, earlier: list[dict[str, Any]], own: list[dict[str, Any]]
) -> list[ChatMessage]:
    """The job's messages: the instructions as a system message, the items before this response (a
    previous response's), then its own. A `function_call_output` must answer a call made before it
    (400 naming its `call_id`)."""
    messages = Conversation()
    if instructions:
        messages.add("system", instructions)
    calls: set[str] = set()
    for position, item in enumerate([*earlier, *own]):
        kind = item["type"]
        if kind == "function_call":
            calls.add(item["call_id"])
            messages.add_calls([call_text(item["name"], item["arguments"], "input")])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                where = f"input.{position - len(earlier)}.call_id"
                raise ApiError(
                    400, f"{where}: no function_call with call_id {item['call_id']!r} before it", param=where
                )
            messages.add_result(item["output"])
        elif kind == "message":
            messages.add(_ROLES[item["role"]], item_text(item))
    return messages.messages()
