"""`ortfleet bench structured`: does constrained JSON come back whole? On a local fleet or a server at --url.

- Parse: ten small pydantic models, one prompt each, sent through the `openai` SDK's
  `chat.completions.parse` (a `json_schema` response format, strict) with `max_tokens` --parse-tokens
  (120) and greedy decoding. A request counts when the SDK hands back a parsed object: the answer ended
  on its own (no `length` finish) and validates against the model.
- JSON object: ten prompts with `response_format: {"type": "json_object"}` and `max_tokens`
  --object-tokens (60). A request counts when the answer ended on its own and is one JSON object.

The figures are the counts out of ten, with every answer's text and the reason a miss missed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from tqdm import tqdm

from common import aio
from ortfleet.bench.http import served_model
from ortfleet.bench.report import figures_header, table
from ortfleet.bench.serving import LOCAL_NAME
from ortfleet.fleet.launcher import serving_fleet

GOAL_PARSED = 9  # of the ten parse requests, at least
GOAL_OBJECTS = 9  # of the ten json_object requests, at least


class City(BaseModel):
    name: str
    country: str
    population_millions: float


class Person(BaseModel):
    name: str
    age: int
    occupation: str


class Book(BaseModel):
    title: str
    author: str
    year: int


class Recipe(BaseModel):
    dish: str
    ingredients: list[str]
    minutes: int


class Weather(BaseModel):
    city: str
    temperature_celsius: float
    sunny: bool


class Product(BaseModel):
    name: str
    price_usd: float
    in_stock: bool


class Movie(BaseModel):
    title: str
    year: int
    genre: str


class Animal(BaseModel):
    species: str
    legs: int
    can_fly: bool


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool


class Meeting(BaseModel):
    topic: str
    day: str
    attendees: list[str]


PARSE_CASES: list[tuple[type[BaseModel], str]] = [
    (City, "Describe Paris as JSON."),
    (Person, "Invent a person who works in a bakery and describe them."),
    (Book, "Tell me about the novel Moby-Dick."),
    (Recipe, "Give me a simple pancake recipe."),
    (Weather, "What is the weather like in Madrid on a summer afternoon?"),
    (Product, "Describe a cheap umbrella sold in a shop."),
    (Movie, "Tell me about the film Casablanca."),
    (Animal, "Describe a spider."),
    (Planet, "Describe the planet Saturn."),
    (Meeting, "Plan a team meeting about the budget on Monday with Ann and Bob."),
]
OBJECT_PROMPTS = [
    "Describe a cat as a JSON object.",
    "Give a JSON object with the name and capital of France.",
    "Return a JSON object describing a red car.",
    "Describe your favourite fruit in JSON.",
    "Give the days of a weekend as a JSON object.",
    "Write a JSON object about a dog called Rex.",
    "Describe the sun in a JSON object.",
    "Give a JSON object with a greeting in English and in Spanish.",
    "Describe a bicycle as JSON.",
    "Return a JSON object for a book with its title and author.",
]


@dataclass(frozen=True)
class StructuredOptions:
    model_dir: Path | None
    parse_tokens: int
    object_tokens: int
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
    figures = figures_header(
        "structured",
        options.command_line,
        load_at_start,
        options.model_dir,
        {"parse_tokens": options.parse_tokens, "object_tokens": options.object_tokens},
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
    parsed: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    with tqdm(total=len(PARSE_CASES) + len(OBJECT_PROMPTS), desc="structured", file=sys.stderr) as bar:
        for schema, prompt in PARSE_CASES:
            parsed.append(_parse_one(client, model, schema, prompt, options.parse_tokens))
            bar.update()
        for prompt in OBJECT_PROMPTS:
            objects.append(_object_one(client, model, prompt, options.object_tokens))
            bar.update()
    return {
        "parse": {"ok": sum(r["ok"] for r in parsed), "of": len(parsed), "requests": parsed},
        "json_object": {"ok": sum(r["ok"] for r in objects), "of": len(objects), "requests": objects},
    }


def _parse_one(
    client: Any, model: str, schema: type[BaseModel], prompt: str, max_tokens: int
) -> dict[str, Any]:
    import openai

    record: dict[str, Any] = {"schema": schema.__name__, "prompt": prompt}
    try:
        completion = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=schema,
            max_tokens=max_tokens,
            temperature=0,
        )
    except openai.LengthFinishReasonError as e:
        return record | _answer(e.completion) | {"ok": False, "miss": "length: no end within max_tokens"}
    except ValidationError as e:
        return record | {"ok": False, "miss": f"does not validate: {e.errors()[0]['msg']}"}
    message = completion.choices[0].message
    if message.parsed is None:
        return record | _answer(completion) | {"ok": False, "miss": f"refused: {message.refusal}"}
    return record | _answer(completion) | {"ok": True}


def _answer(completion: Any) -> dict[str, Any]:
    choice = completion.choices[0]
    return {
        "text": choice.message.content,
        "finish_reason": choice.finish_reason,
        "completion_tokens": completion.usage.completion_tokens,
    }


def _object_one(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        max_tokens=max_tokens,
        temperature=0,
    )
    choice = completion.choices[0]
    record: dict[str, Any] = {
        "prompt": prompt,
        "text": choice.message.content,
        "finish_reason": choice.finish_reason,
        "completion_tokens": completion.usage.completion_tokens,
    }
    if choice.finish_reason == "length":
        return record | {"ok": False, "miss": "length: the object did not close within max_tokens"}
    try:
        value = json.loads(choice.message.content or "")
    except json.JSONDecodeError as e:
        return record | {"ok": False, "miss": f"not JSON: {e}"}
    if not isinstance(value, dict):
        return record | {"ok": False, "miss": "not an object"}
    return record | {"ok": True}


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    options = figures["options"]
    return [
        {
            "goal": f"chat.completions.parse: at least {GOAL_PARSED} of 10 parsed within "
            f"{options['parse_tokens']} tokens",
            "figure": figures["parse"]["ok"],
            "pass": figures["parse"]["ok"] >= GOAL_PARSED,
        },
        {
            "goal": f"json_object: at least {GOAL_OBJECTS} of 10 closed within "
            f"{options['object_tokens']} tokens",
            "figure": figures["json_object"]["ok"],
            "pass": figures["json_object"]["ok"] >= GOAL_OBJECTS,
        },
    ]


def text(figures: dict[str, Any]) -> str:
    rows = [
        [
            "parse",
            r["schema"],
            "yes" if r["ok"] else "no",
            r["completion_tokens"],
            r.get("miss", ""),
        ]
        for r in figures["parse"]["requests"]
    ]
    rows += [
        [
            "json_object",
            r["prompt"][:32],
            "yes" if r["ok"] else "no",
            r["completion_tokens"],
            r.get("miss", ""),
        ]
        for r in figures["json_object"]["requests"]
    ]
    lines = [
        f"structured output on {figures['server']} ({figures['served_name']})",
        table(["kind", "case", "whole", "tokens", "miss"], rows),
        "goals:",
        *(f"  {'pass' if g['pass'] else 'FAIL'}  {g['goal']} ({g['figure']})" for g in figures["goals"]),
    ]
    return "\n".join(lines)
