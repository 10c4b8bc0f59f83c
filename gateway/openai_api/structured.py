"""Structured output as OpenAI and vLLM ask for it, turned into the job's `response_format`.

OpenAI: `response_format` of type `text`, `json_object` or `json_schema` (on Responses, `text.format`,
whose `json_schema` holds `name`, `schema` and `strict` beside its `type`). vLLM: `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (Lark syntax), or the newer `structured_outputs`
object with `json`, `regex`, `choice`, `grammar` or `json_object`. At most one of them per request.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from common.error_codes import ErrorCode
from common.guidance import ResponseFormat
from common.wire import ChatMessage, with_system_text
from gateway.errors import ApiError
from gateway.openai_api.protocol import GenerationParams

_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def response_format(body: GenerationParams) -> ResponseFormat | None:
    """The one structured-output request of `body`; 400 naming the field when it is malformed or when
    more than one is given."""
    given = {
        name: value
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if (value := getattr(body, name)) is not None
    }
    if body.structured_outputs is not None:
        given["structured_outputs"] = body.structured_outputs
    if given.get("response_format") in ({"type": "text"}, "text"):
        del given["response_format"]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(given)
        raise ApiError(400, f"{names}: give at most one way to constrain the output", param=next(iter(given)))
    name, value = next(iter(given.items()))
    return _parse(name, _raw_format(name, value))


def _raw_format(name: str, value: Any) -> dict[str, Any]:
    if name == "response_format":
        if not isinstance(value, dict):
            raise ApiError(400, "response_format: must be an object with a 'type'", param=name)
        return value
    if name == "guided_json":
        return {"type": "json_schema", "json_schema": {"schema": _schema(name, value)}}
    if name == "guided_regex":
        return {"type": "regex", "regex": value}
    if name == "guided_choice":
        return {"type": "choice", "choice": value}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": value}
    return _structured_outputs(value)


def _structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs: must be an object", param="structured_outputs")
    set_fields = {k: v for k, v in value.items() if v is not None and v is not False}
    if set_fields.keys() - {*_STRUCTURED_OUTPUTS, "json_object"}:
        unknown = sorted(set_fields.keys() - {*_STRUCTURED_OUTPUTS, "json_object"})[0]
        raise ApiError(
            400,
            f"structured_outputs.{unknown}: not supported by ortfleet (json, regex, choice, grammar or "
            "json_object)",
            param=f"structured_outputs.{unknown}",
            code=ErrorCode.unsupported_parameter,
        )
    if len(set_fields) != 1:
        raise ApiError(400, "structured_outputs: give exactly one of its fields", param="structured_outputs")
    key, inner = next(iter(set_fields.items()))
    if key == "json_object":
        return {"type": "json_object"}
    if key == "json":
        return {"type": "json_schema", "json_schema": {"schema": _schema("structured_outputs.json", inner)}}
    return {"type": _STRUCTURED_OUTPUTS[key], key: inner}


def _schema(name: str, value: Any) -> Any:
    """vLLM takes a schema as an object or as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{name}: not a JSON schema: {e}", param=name) from e
    return value


def text_format(text: Any) -> ResponseFormat | None:
    """A Responses request's `text.format`: `text` (None), `json_object` or `json_schema`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "text: must be an object with a 'format'", param="text")
    value = text.get("format")
    if value is None or value == {"type": "text"}:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "text.format: must be an object with a 'type'", param="text.format")
    kind = value.get("type")
    if kind not in ("json_object", "json_schema"):
        raise ApiError(
            400,
            f"text.format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
            param="text.format.type",
        )
    if kind == "json_object":
        return _parse("text.format", value)
    if "schema" not in value:
        raise ApiError(400, "text.format.schema: required", param="text.format.schema")
    inner = {k: v for k, v in value.items() if k != "type"}
    return _parse("text.format", {"type": "json_schema", "json_schema": inner})


def _parse(name: str, raw: dict[str, Any]) -> ResponseFormat:
    try:
        return ResponseFormat.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        if name == "text.format" and loc[:1] == ["json_schema"]:
            loc = loc[1:]  # flat on Responses
        where = ".".join(loc)
        param = f"{name}.{where}" if name in ("response_format", "text.format") and where else name
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise ApiError(400, f"{param}: {message.removeprefix('Value error, ')}", param=param) from e


def with_schema_shown(
    messages: list[ChatMessage], asked: ResponseFormat | None, shown: bool
) -> list[ChatMessage]:
    """The conversation with the JSON schema asked for told to the model in its system message, as OpenAI
    does (`shown`: ORTFLEET_STRUCTURED_OUTPUT_PROMPT); as it is for other formats."""
    if not shown or asked is None or (text := asked.prompt_text()) is None:
        return messages
    return with_system_text(messages, text)
