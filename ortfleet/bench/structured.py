"""`ortfleet bench structured`: does constrained JSON come back whole? On a local fleet or a server at --url.

- Parse: ten small pydantic models, one prompt each, sent through the `openai` SDK's
  `chat.completions.parse` (a `json_schema` response format, strict) at each `max_tokens` of
  --parse-tokens (40, 60, 120), greedy. A request counts when the SDK hands back a parsed object: the
  answer ended (on its own or closed early, never `length`) and validates against the model.
- JSON object: ten prompts with `response_format: {"type": "json_object"}` at each `max_tokens` of
  --object-tokens (20, 60). A request counts when the answer ended and is one JSON object.
- Tool calls: five prompts, each with its tool named in `tool_choice` and with `tool_choice: "required"`,
  at each `max_tokens` of --tool-tokens (24). A request counts when it made one call whose arguments
  parse and validate against its tool's schema.

Every request is sent twice: as asked (ortfleet closes a document max_tokens would cut) and with
`close_early: false` (the text as the model wrote it). The figures are the counts out of ten, how many
answers were closed early, and, of the answers the model ended on its own, how many are the same text
either way (the closing never acts early); with every answer's text and the reason a miss missed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from tqdm import tqdm

from common import aio
from ortfleet.bench.http import served_model
from ortfleet.bench.report import figures_header, table
from ortfleet.bench.serving import LOCAL_NAME
from ortfleet.bench.structured_cases import OBJECT_PROMPTS, PARSE_CASES, TOOL_ARGUMENTS, TOOL_CASES, TOOLS
from ortfleet.fleet.launcher import serving_fleet

T = TypeVar("T")
GOAL = 10  # of the ten requests of each kind and budget, at least


@dataclass(frozen=True)
class StructuredOptions:
    model_dir: Path | None
    parse_tokens: list[int]
    object_tokens: list[int]
    tool_tokens: list[int]
    url: str | None
    name: str | None
    api_key: str | None
    command_line: str


def run(options: StructuredOptions) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    if options.url is not None:
        name = options.name or aio.run(served_model(options.url))
        measured = _measure(options, options.url, name)
    else:
        assert options.model_dir is not None
        with serving_fleet(options.model_dir, LOCAL_NAME) as url:
            name = LOCAL_NAME
            measured = _measure(options, url, name)
    budgets = {
        "parse_tokens": options.parse_tokens,
        "object_tokens": options.object_tokens,
        "tool_tokens": options.tool_tokens,
    }
    figures = figures_header(
        "structured",
        options.command_line,
        load_at_start,
        options.model_dir,
        budgets,
        server=options.url or "local ortfleet fleet of 1 worker (started by the bench)",
        served_name=name,
    )
    figures |= measured
    figures["goals"] = goals(figures)
    return figures


def _measure(options: StructuredOptions, url: str, model: str) -> dict[str, Any]:
    try:
        import openai
    except ImportError as e:  # the fleet-only install leaves the SDK out
        raise SystemExit("ortfleet bench structured: needs the openai package (pip install openai)") from e
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=options.api_key or "none", max_retries=0, timeout=600
    )
    runs: dict[str, tuple[list[int], list[Any], Any]] = {
        "parse": (options.parse_tokens, list(PARSE_CASES), _parse_one),
        "json_object": (options.object_tokens, list(OBJECT_PROMPTS), _object_one),
        "tool_calls": (options.tool_tokens, _tool_requests(), _tool_one),
    }
    total = sum(len(budgets) * len(cases) for budgets, cases, _ in runs.values())
    measured: dict[str, Any] = {}
    with tqdm(total=total, desc="structured", file=sys.stderr) as bar:
        for kind, (budgets, cases, one) in runs.items():
            measured[kind] = []
            for budget in budgets:
                records = []
                for case in cases:
                    records.append(one(client, model, case, budget))
                    bar.update()
                measured[kind].append(_summary(budget, records))
    return measured


def _tool_requests() -> list[tuple[str, str, Any]]:
    named = [(tool, prompt, {"type": "function", "function": {"name": tool}}) for tool, prompt in TOOL_CASES]
    return named + [(tool, prompt, "required") for tool, prompt in TOOL_CASES]


def _summary(budget: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    alone = [r for r in records if r["without_closing"]["ended"]]
    return {
        "max_tokens": budget,
        "ok": sum(r["ok"] for r in records),
        "of": len(records),
        "closed_early": sum(bool(r.get("closed_early")) for r in records),
        "ok_without_closing": sum(r["without_closing"]["ok"] for r in records),
        "ended_alone": len(alone),
        "unchanged": sum(r["text"] == r["without_closing"]["text"] for r in alone),
        "requests": records,
    }


def _twice(send: Callable[[dict[str, Any]], T]) -> tuple[T, T]:
    """The answer as asked, and with close_early false."""
    return send({}), send({"close_early": False})


def _parse_one(client: Any, model: str, case: tuple[type[BaseModel], str], max_tokens: int) -> dict[str, Any]:
    import openai

    schema, prompt = case

    def send(extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        try:
            completion = client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                response_format=schema,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
        except openai.LengthFinishReasonError as e:
            return _answer(e.completion) | {"ok": False, "miss": "length: no end within max_tokens"}, None
        except ValidationError as e:
            return {"ok": False, "miss": f"does not validate: {e.errors()[0]['msg']}"}, None
        except openai.BadRequestError as e:
            return {"ok": False, "miss": f"400: {e.message}"}, None
        message = completion.choices[0].message
        if message.parsed is None:
            return _answer(completion) | {"ok": False, "miss": f"refused: {message.refusal}"}, None
        return _answer(completion) | {"ok": True}, message.parsed

    (asked, _), (plain, _) = _twice(send)
    return {"schema": schema.__name__, "prompt": prompt} | asked | {"without_closing": _brief(plain)}


def _answer(completion: Any) -> dict[str, Any]:
    choice = completion.choices[0]
    return {
        "text": choice.message.content,
        "finish_reason": choice.finish_reason,
        "closed_early": bool((choice.model_extra or {}).get("closed_early")),
        "completion_tokens": completion.usage.completion_tokens,
    }


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    """What the opted-out request gave: its text, whether it ended on its own, whether it counts."""
    ended = record.get("finish_reason") not in (None, "length")
    return {"text": record.get("text"), "ended": ended, "ok": record["ok"]}


def _object_one(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    import openai

    def send(extra: dict[str, Any]) -> dict[str, Any]:
        try:
            completion = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                response_format={"type": "json_object"},
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
        except openai.BadRequestError as e:
            return {"ok": False, "miss": f"400: {e.message}"}
        record = _answer(completion)
        if record["finish_reason"] == "length":
            return record | {"ok": False, "miss": "length: the object did not close within max_tokens"}
        try:
            value = json.loads(record["text"] or "")
        except json.JSONDecodeError as e:
            return record | {"ok": False, "miss": f"not JSON: {e}"}
        if not isinstance(value, dict):
            return record | {"ok": False, "miss": "not an object"}
        return record | {"ok": True}

    asked, plain = _twice(send)
    record: dict[str, Any] = {"prompt": prompt} | asked | {"without_closing": _brief(plain)}
    return record


def _tool_one(client: Any, model: str, case: tuple[str, str, Any], max_tokens: int) -> dict[str, Any]:
    tool, prompt, tool_choice = case

    import openai

    def send(extra: dict[str, Any]) -> dict[str, Any]:
        try:
            completion = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                tools=TOOLS,
                tool_choice=tool_choice,
                parallel_tool_calls=False,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
        except openai.BadRequestError as e:
            return {"ok": False, "miss": f"400: {e.message}"}
        record = _answer(completion)
        calls = completion.choices[0].message.tool_calls or []
        record["text"] = (
            json.dumps([[c.function.name, c.function.arguments] for c in calls]) if calls else None
        )
        if len(calls) != 1:
            return record | {"ok": False, "miss": f"{len(calls)} complete calls"}
        name, arguments = calls[0].function.name, calls[0].function.arguments
        try:
            TOOL_ARGUMENTS[name].model_validate_json(arguments)
        except ValidationError as e:
            return record | {"ok": False, "miss": f"arguments: {e.errors()[0]['msg']}"}
        return record | {"ok": True}

    asked, plain = _twice(send)
    choice = "required" if tool_choice == "required" else "named"
    return (
        {"tool": tool, "tool_choice": choice, "prompt": prompt} | asked | {"without_closing": _brief(plain)}
    )


_KINDS = {
    "parse": ("chat.completions.parse", "parsed"),
    "json_object": ("json_object", "one whole object"),
    "tool_calls": ("tool calls (named, required)", "arguments parse and validate"),
}


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "goal": f"{title}: at least {GOAL} of 10 {what} within {run['max_tokens']} tokens",
            "figure": run["ok"],
            "pass": run["ok"] >= GOAL,
        }
        for kind, (title, what) in _KINDS.items()
        for run in figures[kind]
    ]


def text(figures: dict[str, Any]) -> str:
    rows = []
    for kind in _KINDS:
        for run in figures[kind]:
            for r in run["requests"]:
                case = r.get("schema") or r.get("tool") or r["prompt"][:32]
                if "tool_choice" in r:
                    case = f"{case} ({r['tool_choice']})"
                rows.append(
                    [
                        kind,
                        run["max_tokens"],
                        case,
                        "yes" if r["ok"] else "no",
                        "yes" if r["without_closing"]["ok"] else "no",
                        "closed" if r.get("closed_early") else "",
                        r.get("completion_tokens", ""),
                        r.get("miss", ""),
                    ]
                )
    summary = [
        [kind, run["max_tokens"], f"{run['ok']}/{run['of']}", f"{run['ok_without_closing']}/{run['of']}",
         run["closed_early"], f"{run['unchanged']}/{run['ended_alone']}"]
        for kind in _KINDS
        for run in figures[kind]
    ]  # fmt: skip
    lines = [
        f"structured output on {figures['server']} ({figures['served_name']})",
        table(
            ["kind", "max_tokens", "case", "whole", "whole (close_early false)", "", "tokens", "miss"], rows
        ),
        "",
        table(["kind", "max_tokens", "whole", "close_early false", "closed early", "unchanged"], summary),
        "unchanged: of the answers the model ended on its own, those the same text with closing on",
        "goals:",
        *(f"  {'pass' if g['pass'] else 'FAIL'}  {g['goal']} ({g['figure']})" for g in figures["goals"]),
    ]
    return "\n".join(lines)
