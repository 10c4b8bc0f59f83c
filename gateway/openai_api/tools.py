"""Tool calling, for chat completions and Responses alike: the request's tools, how the model is told
about them, the grammar that keeps its calls valid, and calls and results written back into the
conversation.

Chat nests a function in its tool (`{"type": "function", "function": {"name", ...}}`, a named choice
`{"type": "function", "function": {"name"}}`); Responses writes it flat (`{"type": "function", "name",
...}`, a named choice `{"type": "function", "name"}`). Both become one `ToolPlan`.

ortfleet shows tools to the model in its own prompt format, the same for every model (docs/api.md,
"Tool calling"): a system message lists the tools and the call syntax, a call is written
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and a tool's result comes back in a user
message between `<tool_response>` tags. Earlier calls and results in the conversation are rendered the
same way, so the worker applies the model's chat template to plain system, user and assistant messages.

Decoding is constrained by a Lark grammar (llguidance): `required` and a named function allow only calls
whose arguments match the tool's JSON Schema; `auto` allows free text that does not start with `<`, or
calls, so a call the model starts is complete and valid whatever it samples.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.error_codes import ErrorCode
from common.guidance import ResponseFormat, bounded_numbers
from common.wire import ChatMessage, with_system_text
from gateway import guidance_check
from gateway.errors import ApiError

TOOL_PROMPT = "ortfleet"  # tools reach every model in ortfleet's prompt format, not its own template's
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"
MAX_TOOLS = 128  # OpenAI's bound on `tools`
MAX_GRAMMAR_CHARS = 65_536  # what a job's grammar may hold (common/guidance.py)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_COMPACT = {"whitespace_flexible": False}  # as common/guidance.py: no runs of whitespace to fill

# A text answer to a conversation that holds calls or results, when no call may follow (no tools, or
# tool_choice "none"): it may not begin with "<", as auto's text may not, so that a weak model cannot
# write the calls and results it sees there as its answer (they are rendered in tags).
TEXT_AFTER_TOOLS = ResponseFormat(type="regex", regex=r"[^<][\s\S]*")

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

ToolMode = Literal["none", "auto", "required", "named"]


class FunctionDef(BaseModel):
    """A function the model may call: OpenAI's `tools[].function`, or a legacy `functions[]` entry."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(..., pattern=_NAME.pattern, description="Letters, digits, _ and -, up to 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of an object.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")

    def arguments_schema(self) -> dict[str, Any]:
        schema = self.parameters if self.parameters is not None else _NO_PARAMETERS
        return schema if "type" in schema else {**schema, "type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tools: the functions, the choice and whether several calls may come."""

    functions: list[FunctionDef]
    mode: ToolMode
    named: str | None = None  # the function a named choice forces
    parallel: bool = True
    legacy: bool = False  # `functions`/`function_call`: answered as `message.function_call`
    flat: bool = False  # Responses' tools: `tools.N.parameters`, not `tools.N.function.parameters`

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    def system_text(self) -> str:
        """The fallback prompt: the functions the model may call now, the call syntax and the choice."""
        shown = [f for f in self.functions if self.mode != "named" or f.name == self.named]
        listing = []
        for f in shown:
            entry: dict[str, Any] = {"name": f.name}
            if f.description:
                entry["description"] = f.description
            entry["parameters"] = f.arguments_schema()
            listing.append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
        lines = [
            "Functions (with the JSON Schema of their arguments):",
            *listing,
            f'To call one, reply only: {CALL_OPEN}{{"name":"...","arguments":{{...}}}}{CALL_CLOSE}',
            f"Results come as {RESULT_OPEN}...{RESULT_CLOSE}",
        ]
        if self.parallel and self.mode != "named":
            lines.append("Several calls: one a line.")
        if self.mode == "required":
            lines.append("Call a function now.")
        elif self.mode == "named":
            lines.append(f"Call {self.named} now.")
        else:
            lines.append("Call one if it helps, else reply in text.")
        return "\n".join(lines)

    def grammar(self) -> str:
        """The Lark grammar the answer must follow (for `auto`, `required` and a named function)."""
        functions = [f for f in self.functions if self.mode != "named" or f.name == self.named]
        rules = [
            f"call_{i}: {json.dumps(CALL_OPEN)} %json {json.dumps(bounded_numbers(_call_schema(f)))} "
            f"{json.dumps(CALL_CLOSE)}"
            for i, f in enumerate(functions)
        ]
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
        many = self.parallel and self.mode != "named"
        calls = f"calls: call ({json.dumps(CALL_SEPARATOR)} call)*" if many else "calls: call"
        start = "start: TEXT | calls" if self.mode == "auto" else "start: calls"
        text = [r"TEXT: /[^<][\s\S]*/"] if self.mode == "auto" else []
        return "\n".join([start, *text, calls, call, *rules]) + "\n"

    def response_format(self) -> ResponseFormat | None:
        """The job's grammar; 400 naming the tools when their schemas make it longer than a job takes."""
        if not self.calls_allowed:
            return None
        grammar = self.grammar()
        if len(grammar) > MAX_GRAMMAR_CHARS:
            field = "functions" if self.legacy else "tools"
            message = (
                f"{field}: the schemas make a grammar of {len(grammar)} characters, more than "
                f"{MAX_GRAMMAR_CHARS}; send fewer or smaller tools"
            )
            raise ApiError(400, message, param=field)
        return ResponseFormat(type="grammar", grammar=grammar)


def _call_schema(function: FunctionDef) -> dict[str, Any]:
    """A call of the function as one JSON object. The arguments' definitions move to the root, where
    their references (`#/$defs/...`, as pydantic writes them) point once the schema is nested."""
    arguments = closed_objects(dict(function.arguments_schema()))
    definitions: dict[str, Any] = {k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
        "x-guidance": _COMPACT,
    }


def closed_objects(schema: Any) -> Any:
    """The schema with every object that declares its properties and says nothing of others closed to
    them (`additionalProperties: false`), as OpenAI's strict mode has it: a call's arguments then hold
    only what the tool declares. Open, a weak model adds keys until max_tokens. An object that sets
    `additionalProperties` (or `patternProperties`) keeps it."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = {
        k: v if k in ("enum", "const", "default", "examples") else closed_objects(v)
        for k, v in schema.items()
    }
    if "properties" in node and "additionalProperties" not in node and "patternProperties" not in node:
        node["additionalProperties"] = False
    return node


def tool_plan(body: Any) -> ToolPlan | None:
    """The request's tools and choice (`tools`/`tool_choice` or the legacy `functions`/`function_call`);
    None when it gives neither tools nor functions. 400 naming the field for a malformed one."""
    tools, functions = body.tools, body.functions
    if tools not in (None, []) and functions not in (None, []):
        raise ApiError(400, "tools, functions: give one of them, not both", param="functions")
    legacy = functions not in (None, [])
    if legacy:
        defs = _functions(functions, "functions")
        choice_field, choice = "function_call", body.function_call
    else:
        defs = _tool_functions(tools, flat=False)
        choice_field, choice = "tool_choice", body.tool_choice
        if body.function_call is not None and body.function_call != "none":
            raise ApiError(400, "function_call: needs functions", param="function_call")
    parallel = body.parallel_tool_calls is not False and not legacy  # a legacy answer holds one call
    mode, named = _choice(choice, choice_field, defs, legacy)
    if not defs:
        return None
    return ToolPlan(defs, mode, named, parallel, legacy)


def flat_tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The tools and choice of a Responses request (flat function tools); None without tools."""
    defs = _tool_functions(tools, flat=True)
    mode, named = _choice(tool_choice, "tool_choice", defs, legacy=False, flat=True)
    if not defs:
        return None
    return ToolPlan(defs, mode, named, parallel_tool_calls is not False, flat=True)


def _tool_functions(tools: Any, *, flat: bool) -> list[FunctionDef]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list of tools", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"tools.{i}: must be an object", param=f"tools.{i}")
        if tool.get("type") != "function":
            raise ApiError(
                400,
                f"tools.{i}.type: only function tools are supported (got {tool.get('type')!r})",
                param=f"tools.{i}.type",
                code=ErrorCode.unsupported_value,
            )
        if flat:
            functions.append(_function({k: v for k, v in tool.items() if k != "type"}, f"tools.{i}"))
        else:
            functions.append(_function(tool.get("function"), f"tools.{i}.function"))
    return _distinct(functions, "tools")


def _functions(functions: Any, field: str) -> list[FunctionDef]:
    if not isinstance(functions, list):
        raise ApiError(400, f"{field}: must be a list of functions", param=field)
    return _distinct([_function(f, f"{field}.{i}") for i, f in enumerate(functions)], field)


def _distinct(functions: list[FunctionDef], field: str) -> list[FunctionDef]:
    if len(functions) > MAX_TOOLS:
        raise ApiError(400, f"{field}: at most {MAX_TOOLS} functions", param=field)
    seen: set[str] = set()
    for i, function in enumerate(functions):
        if function.name in seen:
            raise ApiError(
                400, f"{field}.{i}: a second function named {function.name!r}", param=f"{field}.{i}"
            )
        seen.add(function.name)
    return functions


def _function(raw: Any, where: str) -> FunctionDef:
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: must be an object with a name", param=where)
    try:
        function = FunctionDef.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        param = f"{where}.{field}" if field else where
        message = first["msg"]
        if first["type"] == "string_pattern_mismatch":
            message = "letters, digits, underscores and dashes only, 1 to 64 of them"
        raise ApiError(400, f"{param}: {message}", param=param) from e
    if function.arguments_schema().get("type") != "object":
        raise ApiError(
            400, f"{where}.parameters: must be the JSON Schema of an object", param=f"{where}.parameters"
        )
    return function


def _choice(
    choice: Any, field: str, functions: list[FunctionDef], legacy: bool, flat: bool = False
) -> tuple[ToolMode, str | None]:
    names = {f.name for f in functions}
    if choice is None:
        return ("auto" if functions else "none"), None
    if choice in ("none", "auto") or (choice == "required" and not legacy):
        if choice != "none" and not functions:
            if choice == "auto":
                return "none", None
            raise ApiError(400, f"{field}: {choice!r} needs tools", param=field)
        return choice, None
    name = None
    if isinstance(choice, dict):
        inner = choice if legacy or flat else choice.get("function")
        if (legacy or choice.get("type") == "function") and isinstance(inner, dict):
            name = inner.get("name")
    if not isinstance(name, str):
        if legacy:
            allowed = "'none', 'auto' or {\"name\": ...}"
        elif flat:
            allowed = "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"
        else:
            allowed = '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'

        raise ApiError(400, f"{field}: must be {allowed}", param=field)
    if name not in names:
        raise ApiError(400, f"{field}: no function named {name!r} among the tools", param=field)
    return "named", name


async def check_schemas(plan: ToolPlan) -> None:
    """400 naming the tool whose parameters llguidance cannot compile (or that need more than its limits),
    before the request is queued."""
    field = "functions" if plan.legacy else "tools"
    for i, function in enumerate(plan.functions):
        where = f"{field}.{i}.parameters" if plan.legacy else f"{field}.{i}.function.parameters"
        schema = json.dumps({**function.arguments_schema(), "x-guidance": _COMPACT})
        problem = await asyncio.to_thread(guidance_check.guidance_problem, "json_schema", schema)
        if problem is not None:
            raise ApiError(
                400, f"{where}: {problem.message}", param=where, code=ErrorCode.invalid_response_format
            )


# The conversation -----------------------------------------------------------------------------------


def call_text(name: str, arguments: str, where: str) -> str:
    """One call as the model writes it; `arguments` is OpenAI's JSON string."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}: not valid JSON: {e}", param=where) from e
    body = json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False, separators=(",", ":"))
    return CALL_OPEN + body + CALL_CLOSE


def assistant_calls(message: Any, i: int) -> list[str]:
    """The calls of an assistant message of the conversation (`tool_calls`, or legacy `function_call`)."""
    calls: list[tuple[Any, str]] = []
    if message.tool_calls is not None:
        if not isinstance(message.tool_calls, list):
            raise ApiError(400, f"messages.{i}.tool_calls: must be a list", param=f"messages.{i}.tool_calls")
        for j, call in enumerate(message.tool_calls):
            where = f"messages.{i}.tool_calls.{j}"
            function = call.get("function") if isinstance(call, dict) else None
            calls.append((function, where + ".function"))
    if message.function_call is not None:
        calls.append((message.function_call, f"messages.{i}.function_call"))
    texts = []
    for function, where in calls:
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}.name: required", param=f"{where}.name")
        if not isinstance(arguments, str):
            raise ApiError(400, f"{where}.arguments: must be a JSON string", param=f"{where}.arguments")
        texts.append(call_text(name, arguments, f"{where}.arguments"))
    return texts


def result_text(content: str) -> str:
    return f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"


class Conversation:
    """Chat messages as jobs take them, built in order: a tool's results that follow one another go in
    one user message; calls (`call_text`) join the assistant message before them."""

    def __init__(self) -> None:
        self._messages: list[ChatMessage] = []
        self._results: list[str] = []

    def add(self, role: str, content: str) -> None:
        self._flush()
        self._messages.append(ChatMessage.model_validate({"role": role, "content": content}))

    def add_calls(self, calls: list[str]) -> None:
        self._flush()
        last = self._messages[-1] if self._messages else None
        if last is not None and last.role == "assistant":
            joined = "\n".join([*([last.content] if last.content else []), *calls])
            self._messages[-1] = ChatMessage(role="assistant", content=joined)
        else:
            self._messages.append(ChatMessage(role="assistant", content="\n".join(calls)))

    def add_result(self, content: str) -> None:
        self._results.append(result_text(content))

    def _flush(self) -> None:
        if self._results:
            self._messages.append(ChatMessage(role="user", content="\n".join(self._results)))
            self._results = []

    def messages(self) -> list[ChatMessage]:
        self._flush()
        return list(self._messages)


def with_tools(messages: list[ChatMessage], plan: ToolPlan | None) -> list[ChatMessage]:
    """The conversation with the tools' system text in front (merged into a leading system message)."""
    if plan is None or not plan.calls_allowed:
        return messages
    return with_system_text(messages, plan.system_text())
