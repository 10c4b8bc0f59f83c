"""A conversation's tool results, each the answer to a call made just before it, as OpenAI checks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.errors import ApiError


def check_tool_results(messages: Sequence[Any]) -> None:
    """400 naming the field of the first `tool` message that has no `tool_call_id`, follows no assistant
    message with `tool_calls` (other tool messages may come between), or names none of its calls' ids."""
    open_calls: set[str] | None = None
    for i, message in enumerate(messages):
        if message.role == "assistant":
            open_calls = _call_ids(message.tool_calls) if message.tool_calls else None
        elif message.role == "tool":
            _check_result(message.tool_call_id, open_calls, i)
        elif message.role != "function":  # a legacy result answers the legacy function_call by name
            open_calls = None


def _call_ids(tool_calls: Any) -> set[str]:
    calls = tool_calls if isinstance(tool_calls, list) else []
    return {call["id"] for call in calls if isinstance(call, dict) and isinstance(call.get("id"), str)}


def _check_result(call_id: str | None, open_calls: set[str] | None, i: int) -> None:
    if open_calls is None:
        raise ApiError(
            400,
            f"messages.{i}.role: a 'tool' message must answer a call of the assistant message with "
            "'tool_calls' right before it (other tool messages may come between)",
            param=f"messages.{i}.role",
        )
    field = f"messages.{i}.tool_call_id"
    if call_id is None:
        raise ApiError(400, f"{field}: required: the id of the call this message answers", param=field)
    if call_id not in open_calls:
        known = ", ".join(sorted(open_calls)) or "none"
        raise ApiError(
            400,
            f"{field}: {call_id!r} is not the id of a call in the 'tool_calls' before it (ids: {known})",
            param=field,
        )
