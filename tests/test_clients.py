"""The tools and client libraries people already use, driven against a real fleet: GuideLLM, LiteLLM,
LangChain's ChatOpenAI, the openai SDK's structured `parse`, and a real browser (headless Chromium)."""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from ortfleet.fleet.processes import free_port
from tests.conftest import LOGS, Fleet

# One gateway and one served worker for the module's tests; the browser's test starts a gateway and a
# worker of its own (its gateway's keys, CORS origin and restart).
pytestmark = pytest.mark.module_fleet


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


def chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


async def test_the_openai_sdks_parse_returns_the_pydantic_model(fleet: Fleet, served: str) -> None:
    with openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="unused", max_retries=0) as sdk:
        completion = sdk.chat.completions.parse(
            model=served, messages=chat("Describe a pet."), response_format=Pet, max_tokens=80
        )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)


async def test_langchains_chat_openai_streams_and_gives_structured_output(fleet: Fleet, served: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=served,
        base_url=fleet.gateway_url + "/v1",
        api_key="unused",
        max_tokens=8,
        temperature=0,
        max_retries=0,
    )
    whole = llm.invoke("Hello")
    pieces = [chunk.content for chunk in llm.stream("Hello")]
    assert len(pieces) > 2 and "".join(str(p) for p in pieces) == whole.content
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 8

    structured = ChatOpenAI(
        model=served, base_url=fleet.gateway_url + "/v1", api_key="unused", max_tokens=80, max_retries=0
    ).with_structured_output(Pet)
    assert isinstance(structured.invoke("Describe a pet."), Pet)


async def test_litellms_openai_provider_completes_and_streams(fleet: Fleet, served: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    common: dict[str, Any] = {
        "model": f"openai/{served}",
        "api_base": fleet.gateway_url + "/v1",
        "api_key": "unused",
        "messages": chat("Hello"),
        "max_tokens": 6,
        "temperature": 0,
    }
    reply: Any = await litellm.acompletion(**common)
    assert reply.usage.completion_tokens == 6
    stream: Any = await litellm.acompletion(**common, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == reply.choices[0].message.content


def guidellm_command(target: str, model: str, tokenizer: Path, out: Path, output_tokens: int) -> list[str]:
    """`guidellm run` as docs/api.md gives it, on synthetic prompts, with its default backend validation."""
    guidellm = Path(sys.executable).with_name("guidellm")
    return [
        str(guidellm),
        "run",
        "--backend",
        f"kind=openai_http,target={target},model={model}",
        "--profile",
        "kind=concurrent,streams=2",
        "--constraint",
        "kind=max_requests,count=6",
        "--data",
        f"kind=synthetic_text,prompt_tokens=24,output_tokens={output_tokens}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]


@pytest.mark.slow
def test_guidellm_runs_with_its_default_validation_and_gets_the_output_lengths_it_asks_for(
    fleet: Fleet, served: str, tmp_path: Path
) -> None:
    out = tmp_path / "benchmarks.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = guidellm_command(fleet.gateway_url, served, fleet.model_dir, out, output_tokens=20)
    log = LOGS / f"guidellm-{served}.log"
    with log.open("wb") as sink:
        finished = subprocess.run(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=240, check=False
        )
    assert finished.returncode == 0, log.read_text()[-3000:]
    report = json.loads(out.read_text())
    requests = report["benchmarks"][0]["requests"]
    assert not requests.get("errored") and not requests.get("incomplete"), log.read_text()[-2000:]
    lengths = [r["output_metrics"]["text_tokens"] for r in requests["successful"]]
    assert len(lengths) == 6 and set(lengths) == {20}, lengths


@dataclass
class PageServer:
    url: str
    server: ThreadingHTTPServer


@pytest.fixture
def page_server() -> Iterator[PageServer]:
    """Serves tests/browser_page.html from an origin of its own (another port than the gateway's)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(Path(__file__).parent))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield PageServer(f"http://127.0.0.1:{server.server_address[1]}/browser_page.html", server)
    server.shutdown()
    server.server_close()


@pytest.fixture
def chromium() -> Iterator[Any]:
    """Debian's headless Chromium, driven through Debian's chromedriver (no download)."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail("Chromium is missing: apt-get install chromium chromium-driver (scripts/setup does it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tempfile.mkdtemp(prefix="ortfleet-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(
        service=Service(driver, log_output=str(LOGS / "chromedriver.log")), options=options
    )
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_until(browser: Any, script: str, timeout_s: float = 60) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s, poll_frequency=0.05).until(lambda b: b.execute_script(script))


@pytest.mark.slow
def test_a_browser_page_on_another_origin_streams_a_job_through_a_gateway_restart(
    fleet: Fleet, model_name: str, page_server: PageServer, chromium: Any
) -> None:
    key = "ofk_" + secrets.token_urlsafe(24)
    page_origin = page_server.url.rsplit("/", 1)[0]
    env = {
        "ORTFLEET_API_KEYS": f"browser:{key}",
        "ORTFLEET_CORS_ORIGINS": page_origin,
        "ORTFLEET_STREAM_TOKEN_SECRET": secrets.token_hex(16),
    }
    port = free_port()
    gateway, gateway_url = fleet.start_gateway(env, port=port)
    try:
        fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.02"})
        query = urllib.parse.urlencode({"gateway": gateway_url, "key": key, "model": model_name})
        chromium.get(f"{page_server.url}?{query}")
        wait_until(chromium, "return window.eventIds.length >= 5")
        gateway.terminate()  # the gateway goes away mid-stream
        seen_before = chromium.execute_script("return window.eventIds.length")
        gateway, _ = fleet.start_gateway(env, port=port)
        wait_until(chromium, "return document.getElementById('status').textContent === 'done'", 120)
        shown = chromium.execute_script("return document.getElementById('text').textContent")
        opens = chromium.execute_script("return window.opens")
        ids = chromium.execute_script("return window.eventIds")
        job_id = chromium.execute_script("return window.jobId")
        job = httpx.get(f"{gateway_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"}).json()
    finally:
        gateway.terminate()
    assert job["status"] == "succeeded"
    assert opens >= 2 and len(ids) > seen_before  # it reconnected and went on
    assert len(ids) == len(set(ids))  # no event twice: the browser resumed after the last one it had
    assert shown == job["output"]
