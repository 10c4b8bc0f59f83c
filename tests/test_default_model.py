"""End to end on the real default model: SmolLM2-135M-Instruct, int4, CPU."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.jobs_client import read_events, streamed_text, submit, wait_done

pytestmark = pytest.mark.default_model


async def test_the_default_model_answers_that_the_capital_of_france_is_paris(smollm2: str) -> None:
    async with httpx.AsyncClient(base_url=smollm2, timeout=60) as client:
        job = await submit(
            client,
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 40,
            },
        )
        events = await read_events(client, job["id"])
        done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded", done
    assert "Paris" in done["output"]
    assert streamed_text(events) == done["output"]
    assert done["finish_reason"] in ("stop", "length")


async def test_the_default_model_answers_through_the_openai_sdk(smollm2: str) -> None:
    async with openai.AsyncOpenAI(base_url=smollm2 + "/v1", api_key="unused") as sdk:
        completion = await sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40,
            temperature=0,
        )
        stream = await sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=40,
            temperature=0,
            stream=True,
        )
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    answer = completion.choices[0].message.content or ""
    assert "Paris" in answer
    assert streamed == answer
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_an_echoed_prompts_logprobs_are_those_the_model_gave_when_it_wrote_those_tokens(smollm2: str) -> None:
    """A prompt token's log-probability (from the prefill) is the one the model gave that token when it
    generated it (one decode step at a time), alternatives included: the same tokens in the same order,
    and log-probabilities within 0.25, an alternative's within 0.4 (the int4 model's prefill and decode
    kernels round differently: up to 0.16 apart on an Intel Xeon, an alternative 0.30 apart on an AMD
    EPYC with AVX2; a token one place off would be several units off)."""
    with openai.OpenAI(base_url=smollm2 + "/v1", api_key="unused", max_retries=0) as sdk:
        start = "The capital of France is"
        written = sdk.completions.create(
            model="smollm2", prompt=start, max_tokens=4, temperature=0, logprobs=3
        )
        generated = written.choices[0].logprobs
        assert generated is not None and generated.tokens and generated.top_logprobs
        again = sdk.completions.create(
            model="smollm2", prompt=start + written.choices[0].text, max_tokens=1, echo=True, logprobs=3
        )
        assert again.usage is not None
        echoed = again.choices[0].logprobs
        assert echoed is not None and echoed.tokens and echoed.token_logprobs and echoed.top_logprobs
        n = again.usage.prompt_tokens
        assert echoed.tokens[n - 4 : n] == generated.tokens  # the text tokenizes back into the same tokens
        assert echoed.token_logprobs[n - 4 : n] == pytest.approx(generated.token_logprobs, abs=0.25)
        for prompt_top, generated_top in zip(
            echoed.top_logprobs[n - 4 : n], generated.top_logprobs, strict=True
        ):
            assert prompt_top is not None and generated_top is not None
            assert list(prompt_top) == list(generated_top)  # likeliest first, in both
            assert list(prompt_top.values()) == pytest.approx(list(generated_top.values()), abs=0.4)
