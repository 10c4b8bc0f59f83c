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
