"""Structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs, and the job API's
response_format, enforced by the engine's grammar on a real worker."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from pydantic_core import from_json

from common.guidance import ResponseFormat
from tests.conftest import Fleet
from tests.jobs_client import submit, wait_done

pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def as_person(text: str | None) -> dict[str, Any]:
    assert text is not None
    value: dict[str, Any] = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


async def test_a_strict_json_schema_response_format_gives_output_that_validates(
    sdk: openai.OpenAI, served: str
) -> None:
    for temperature in (0.0, 1.0):
        completion = sdk.chat.completions.create(
            model=served,
            messages=chat("Describe a person."),
            max_tokens=120,
            temperature=temperature,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        as_person(completion.choices[0].message.content)
        assert completion.choices[0].finish_reason == "stop"


def test_the_schema_asked_for_is_shown_to_the_model_unless_a_setting_turns_it_off(
    fleet: Fleet, sdk: openai.OpenAI, served: str
) -> None:
    _, as_sent_url = fleet.start_gateway({"ORTFLEET_STRUCTURED_OUTPUT_PROMPT": "false"})
    asked = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    question = chat("Describe a person.")

    def prompt_tokens(client: openai.OpenAI, **extra: Any) -> int:
        # two tokens of a cut answer: the shortest whole person takes more (close_early would refuse them)
        done = client.chat.completions.create(
            model=served, messages=question, max_tokens=2, extra_body={"close_early": False}, **extra
        )
        assert done.usage is not None
        return done.usage.prompt_tokens

    told = ResponseFormat.model_validate(asked).prompt_text()
    assert told is not None and json.dumps(PERSON, separators=(",", ":")) in told
    with_system = httpx.post(
        f"{fleet.gateway_url}/tokenize",
        json={"model": served, "messages": [{"role": "system", "content": told}, *question]},
    ).json()["count"]
    assert prompt_tokens(sdk, response_format=asked) == with_system
    with openai.OpenAI(base_url=as_sent_url + "/v1", api_key="unused", max_retries=0) as as_sent:
        assert prompt_tokens(as_sent, response_format=asked) == prompt_tokens(as_sent) < with_system
        # Responses' text.format shows it the same way
        text_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
        for client, expected in ((sdk, with_system), (as_sent, prompt_tokens(as_sent))):
            response = client.responses.create(
                model=served,
                input="Describe a person.",
                text=text_format,
                max_output_tokens=16,
                extra_body={"close_early": False},
            )
            assert response.usage is not None and response.usage.input_tokens == expected


async def test_a_seeded_sampled_request_is_guided_too(sdk: openai.OpenAI, served: str) -> None:
    completion = sdk.chat.completions.create(
        model=served,
        messages=chat("Describe a person."),
        max_tokens=120,
        temperature=1.0,
        seed=7,
        extra_body={"guided_json": PERSON},
    )
    as_person(completion.choices[0].message.content)


async def test_vllms_guided_parameters_constrain_chat_and_text_completions(
    sdk: openai.OpenAI, served: str
) -> None:
    regex = sdk.chat.completions.create(
        model=served,
        messages=chat("A code?"),
        max_tokens=30,
        temperature=0,
        extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"},
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", regex.choices[0].message.content or "")
    choice = sdk.completions.create(
        model=served, prompt="Red or green?", max_tokens=10, extra_body={"guided_choice": ["red", "green!"]}
    )
    assert choice.choices[0].text in ("red", "green!")
    grammar = sdk.chat.completions.create(
        model=served,
        messages=chat("Yes?"),
        max_tokens=10,
        extra_body={"guided_grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'},
    )
    assert re.fullmatch(r"yes|no|maybe [0-9]", grammar.choices[0].message.content or "")
    schema_as_text = sdk.completions.create(
        model=served, prompt="Person:", max_tokens=120, extra_body={"guided_json": json.dumps(PERSON)}
    )
    as_person(schema_as_text.choices[0].text)


async def test_vllms_structured_outputs_object_is_accepted(sdk: openai.OpenAI, served: str) -> None:
    choice = sdk.chat.completions.create(
        model=served,
        messages=chat("Pick"),
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )
    assert choice.choices[0].message.content in ("alpha", "beta")
    person = sdk.chat.completions.create(
        model=served,
        messages=chat("Pick"),
        max_tokens=120,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    as_person(person.choices[0].message.content)


async def test_a_streamed_structured_completion_streams_valid_json(sdk: openai.OpenAI, served: str) -> None:
    stream = sdk.chat.completions.create(
        model=served,
        messages=chat("Describe a person."),
        max_tokens=120,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    as_person("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))


async def test_a_job_takes_a_response_format(client: httpx.AsyncClient, served: str) -> None:
    job = await submit(
        client,
        {
            "model": served,
            "prompt": "Person:",
            "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}},
        },
    )
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded"
    as_person(done["output"])
    choice = await submit(
        client,
        {"model": served, "prompt": "?", "response_format": {"type": "choice", "choice": ["x1", "y2"]}},
    )
    assert (await wait_done(client, choice["id"]))["output"] in ("x1", "y2")


async def test_a_grammar_the_engine_cannot_compile_fails_its_request_not_the_worker(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    bad: list[dict[str, Any]] = [
        {"guided_regex": "(unclosed"},
        {"guided_json": {"type": "string", "format": "no-such-format"}},
        {"guided_grammar": "start: ???"},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), max_tokens=5, extra_body=extra)
        assert raised.value.param == "response_format" and raised.value.code == "invalid_response_format"
        assert "cannot use this" in raised.value.message
    job = {"model": served, "prompt": "Hi", "response_format": {"type": "regex", "regex": "(x"}}
    refused = await client.post("/v1/jobs", json=job)  # checked before it is queued, as on every route
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_response_format"
    assert "cannot use this regex" in error["message"]
    after = sdk.chat.completions.create(model=served, messages=chat("Hi"), max_tokens=3, temperature=0)
    assert after.usage is not None and after.usage.completion_tokens == 3  # the worker still serves


MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
]


async def test_a_malformed_or_unexpressible_structured_output_request_is_a_bad_request_naming_it(
    sdk: openai.OpenAI, served: str
) -> None:
    for extra, param in MALFORMED:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), extra_body=extra)
        assert raised.value.param == param, (extra, raised.value.param)
        assert param.split(".")[0] in raised.value.message, extra


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


@pytest.mark.default_model
async def test_the_default_model_answers_in_the_requested_json(smollm2: str) -> None:
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        parsed = sdk.chat.completions.parse(
            model="smollm2",
            messages=chat("What is the capital of France? Answer in JSON."),
            response_format=City,
            max_tokens=120,
            temperature=0,
        )
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and "Paris" in city.name
        question = chat("What is the capital of France? Answer in JSON.")
        prose = sdk.chat.completions.create(model="smollm2", messages=question, max_tokens=40, temperature=0)
        assert not (prose.choices[0].message.content or "").startswith("{")  # unconstrained: in words
        anything = sdk.chat.completions.create(
            model="smollm2",
            messages=question,
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=0,
        )
        # JSON mode constrains every token, not the length: a greedy small model may fill the object until
        # max_tokens. Either way the text is a JSON object, whole when the model ended it.
        content, finish = anything.choices[0].message.content or "", anything.choices[0].finish_reason
        assert finish in ("stop", "length")
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert content.startswith("{")
            assert isinstance(from_json(content, allow_partial="trailing-strings"), dict)
        person = sdk.chat.completions.create(
            model="smollm2",
            messages=chat("Describe a person."),
            max_tokens=120,
            extra_body={"guided_json": PERSON},
        )
        as_person(person.choices[0].message.content)
