"""Log-probabilities, penalties and logit bias through the OpenAI routes and the job API, on a real fleet
whose worker runs ortfleet's batcher (the CPU default); og.Engine, which exposes no logits, refuses them
by name."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Fleet
from tests.jobs_client import Event, read_events, submit, wait_done

pytestmark = pytest.mark.module_fleet  # one gateway and one served worker for the module's tests


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def generated_ids(events: list[Event]) -> list[int]:
    return [token for event in events if event.event == "token" for token in event.data["token_ids"]]


async def test_greedy_chat_logprobs_give_each_token_as_its_own_likeliest_streamed_or_not(
    sdk: openai.OpenAI, served: str
) -> None:
    reply = sdk.chat.completions.create(
        model=served,
        messages=chat("Hello there"),
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert reply.usage is not None and len(content) == reply.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        assert (best.token, best.logprob) == (entry.token, entry.logprob)  # greedy: the likeliest is chosen
        assert entry.logprob <= 0 and entry.bytes
        if not entry.token.startswith("bytes:"):  # else a token that holds part of a character
            assert entry.bytes == list(entry.token.encode())
        ranked = [top.logprob for top in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)

    streamed = []
    for chunk in sdk.chat.completions.create(
        model=served,
        messages=chat("Hello there"),
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ):
        for part in chunk.choices:
            if part.logprobs is not None and part.logprobs.content:
                streamed += part.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)

    plain = sdk.chat.completions.create(model=served, messages=chat("Hello there"), max_tokens=3)
    assert plain.choices[0].logprobs is None


async def test_completion_logprobs_list_tokens_their_logprobs_alternatives_and_offsets(
    sdk: openai.OpenAI, served: str
) -> None:
    reply = sdk.completions.create(
        model=served, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2
    )
    found = reply.choices[0].logprobs
    assert found is not None and found.tokens and found.token_logprobs and found.top_logprobs
    assert found.text_offset is not None
    assert len(found.tokens) == len(found.token_logprobs) == len(found.top_logprobs) == 8
    for token, logprob, alternatives in zip(
        found.tokens, found.token_logprobs, found.top_logprobs, strict=True
    ):
        assert len(alternatives) <= 2 and alternatives[token] == pytest.approx(logprob)
        assert logprob == max(alternatives.values())
    assert found.text_offset[0] == 0 and found.text_offset == sorted(found.text_offset)

    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in sdk.completions.create(
        model=served, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, stream=True
    ):
        for part in chunk.choices:
            if part.logprobs is not None:
                tokens += part.logprobs.tokens or []
                offsets += part.logprobs.text_offset or []
    assert tokens == found.tokens
    assert offsets == found.text_offset


async def test_echo_gives_the_prompt_back_with_its_tokens_logprobs_streamed_or_not(
    sdk: openai.OpenAI, served: str
) -> None:
    prompt = "Once upon a time"
    plain = sdk.completions.create(model=served, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    echoed = sdk.completions.create(
        model=served, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True
    )
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    found, generated = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert found is not None and generated is not None and echoed.usage is not None
    assert found.tokens and found.token_logprobs and found.top_logprobs and found.text_offset
    n = echoed.usage.prompt_tokens
    assert len(found.tokens) == n + 6
    assert "".join(found.tokens[:n]) == prompt
    assert found.token_logprobs[0] is None and found.top_logprobs[0] is None  # nothing comes before it
    for logprob, alternatives in zip(found.token_logprobs[1:n], found.top_logprobs[1:n], strict=True):
        assert logprob is not None and logprob <= 0
        assert alternatives is not None and len(alternatives) == 2
        assert max(alternatives.values()) >= logprob  # a prompt token need not be the likeliest
    assert found.tokens[n:] == generated.tokens and found.token_logprobs[n:] == generated.token_logprobs
    assert found.text_offset[n] == len(prompt) and found.text_offset == sorted(found.text_offset)

    text, tokens = "", []
    for chunk in sdk.completions.create(
        model=served, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True, stream=True
    ):
        for part in chunk.choices:
            text += part.text
            tokens += part.logprobs.tokens or [] if part.logprobs is not None else []
    assert (text, tokens) == (echoed.choices[0].text, found.tokens)
    # without logprobs the prompt comes back as text alone, first
    chunks = sdk.completions.create(
        model=served, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
    )
    texts = [part.text for chunk in chunks for part in chunk.choices if part.text]
    assert texts[0] == prompt and "".join(texts) == echoed.choices[0].text


async def test_a_job_asking_for_prompt_logprobs_gets_a_prompt_event_before_its_tokens(
    client: httpx.AsyncClient, served: str
) -> None:
    job = await submit(
        client, {"model": served, "prompt": "Once upon a time", "max_tokens": 3, "prompt_logprobs": 1}
    )
    assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    events = [event for event in await read_events(client, job["id"]) if event.event in ("prompt", "token")]
    assert [event.event for event in events].count("prompt") == 1 and events[0].event == "prompt"
    prompt = events[0].data
    assert len(prompt["logprobs"]) == len(prompt["token_ids"]) > 1
    assert prompt["logprobs"][0]["logprob"] is None
    assert all(len(entry["top_logprobs"]) == 1 for entry in prompt["logprobs"][1:])
    assert all("logprobs" not in event.data for event in events[1:])  # only the prompt's were asked for


async def test_the_job_api_streams_logprobs_with_each_token_event(
    client: httpx.AsyncClient, served: str
) -> None:
    job = await submit(
        client,
        {"model": served, "prompt": "Once upon a time", "max_tokens": 6, "min_tokens": 6, "logprobs": 1},
    )
    assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    tokens = [event.data for event in await read_events(client, job["id"]) if event.event == "token"]
    assert sum(len(event["token_ids"]) for event in tokens) == 6
    for event in tokens:
        assert len(event["logprobs"]) == len(event["token_ids"])
        for entry in event["logprobs"]:
            assert len(entry["top_logprobs"]) == 1 and entry["logprob"] <= 0


async def test_logit_bias_forces_and_bans_tokens(client: httpx.AsyncClient, served: str) -> None:
    base = {"model": served, "prompt": "Once upon a time", "max_tokens": 5, "min_tokens": 5, "temperature": 0}
    free = await submit(client, base)
    await wait_done(client, free["id"])
    greedy = generated_ids(await read_events(client, free["id"]))

    forced = await submit(client, {**base, "logit_bias": {"100": 100}})
    done = await wait_done(client, forced["id"])
    assert done["status"] == "succeeded", (done["error"], done.get("error_code"))
    assert generated_ids(await read_events(client, forced["id"])) == [100] * 5

    banned = await submit(client, {**base, "logit_bias": {str(greedy[0]): -100}})
    await wait_done(client, banned["id"])
    assert generated_ids(await read_events(client, banned["id"]))[0] != greedy[0]


async def test_a_frequency_penalty_changes_a_greedy_text_that_repeats(
    client: httpx.AsyncClient, served: str
) -> None:
    base = {
        "model": served,
        "prompt": "the the the the",
        "max_tokens": 40,
        "min_tokens": 40,
        "temperature": 0,
    }
    plain = await submit(client, base)
    penalized = await submit(client, {**base, "frequency_penalty": 2.0, "presence_penalty": 2.0})
    await wait_done(client, plain["id"])
    await wait_done(client, penalized["id"])
    repeated = generated_ids(await read_events(client, plain["id"]))
    assert len(set(repeated)) < len(repeated)  # the unpenalized text repeats tokens
    different = generated_ids(await read_events(client, penalized["id"]))
    assert different != repeated
    assert len(set(different)) > len(set(repeated))


async def test_bad_logprob_and_bias_values_are_400s_naming_the_field(sdk: openai.OpenAI, served: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"twelve": 1}}, "logit_bias"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), max_tokens=2, extra_body=extra)
        assert raised.value.param is not None and raised.value.param.startswith(param), (extra, raised.value)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(model=served, prompt="Hi", max_tokens=2, logprobs=6)
    assert raised.value.param == "logprobs"

    with pytest.raises(openai.BadRequestError) as raised:  # the worker knows the vocabulary
        sdk.chat.completions.create(
            model=served, messages=chat("Hi"), max_tokens=2, logit_bias={"10000000": 5}
        )
    assert raised.value.param == "logit_bias" and raised.value.code == "unsupported_value"
    assert "10000000" in raised.value.message and "vocabulary" in raised.value.message


async def test_a_bias_that_is_not_a_finite_number_is_refused_saying_what_a_bias_may_be(
    sdk: openai.OpenAI, client: httpx.AsyncClient, served: str
) -> None:
    for bias in ("NaN", "-Infinity", 100.5):
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(
                model=served, messages=chat("Hi"), max_tokens=2, extra_body={"logit_bias": {"5": bias}}
            )
        assert raised.value.param == "logit_bias.5"
        assert "must be a finite number between -100 and 100" in raised.value.message, raised.value.message
        job = await client.post("/v1/jobs", json={"prompt": "Hi", "logit_bias": {"5": bias}})
        assert job.status_code == 422 and job.json()["error"]["param"] == "logit_bias.5"
        assert "finite number between -100 and 100" in job.json()["error"]["message"]


async def test_a_flag_that_is_no_boolean_or_a_min_p_outside_0_to_1_is_refused_naming_it(
    sdk: openai.OpenAI, served: str
) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
        ({"stream": "true"}, "stream", "valid boolean"),
        ({"min_p": 2}, "min_p", "from 0 to 1"),
        ({"min_p": -0.1}, "min_p", "from 0 to 1"),
        ({"min_p": 0.5}, "min_p", "not supported"),  # in range, but no sampler of ortfleet's does it
    ]
    for extra, param, says in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=served, messages=chat("Hi"), max_tokens=2, extra_body=extra)
        assert raised.value.param == param and says in raised.value.message, (extra, raised.value.message)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.completions.create(model=served, prompt="Hi", max_tokens=2, extra_body={"min_p": 1.5})
    assert raised.value.param == "min_p"
    off = sdk.chat.completions.create(
        model=served, messages=chat("Hi"), max_tokens=2, parallel_tool_calls=False, extra_body={"min_p": 0}
    )
    assert off.choices[0].finish_reason in ("stop", "length")


async def test_og_engine_refuses_what_needs_logits_by_name(fleet: Fleet, model_name: str) -> None:
    fleet.start_worker(model_name, "--scheduler", "og-engine")
    async with openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as sdk:
        for extra, param in [
            ({"logprobs": True}, "logprobs"),
            ({"presence_penalty": 1.0}, "presence_penalty"),
            ({"logit_bias": {"5": 3}}, "logit_bias"),
        ]:
            with pytest.raises(openai.BadRequestError) as raised:
                await sdk.chat.completions.create(
                    model=model_name, messages=chat("Hi"), max_tokens=2, extra_body=extra
                )
            assert raised.value.param == param and raised.value.code == "unsupported_parameter"
            assert "og.Engine" in raised.value.message
        ordinary = await sdk.chat.completions.create(model=model_name, messages=chat("Hi"), max_tokens=2)
        assert ordinary.choices[0].message.content is not None
        # echo alone needs no logits: the prompt comes back on og.Engine too
        echoed = await sdk.completions.create(model=model_name, prompt="Hi there", max_tokens=2, echo=True)
        assert echoed.choices[0].text.startswith("Hi there")
        with pytest.raises(openai.BadRequestError) as raised:
            await sdk.completions.create(model=model_name, prompt="Hi", max_tokens=2, echo=True, logprobs=1)
        assert raised.value.param == "logprobs" and raised.value.code == "unsupported_parameter"
