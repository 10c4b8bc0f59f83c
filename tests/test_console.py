"""The web console at `/`: its page and assets as the gateway serves them, `GET /v1/fleet` that it draws
the fleet from, and the console itself in headless Chromium against a real fleet."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from common.gateway_settings import GatewaySettings
from gateway.app import build_app
from gateway.console import ASSETS, asset_names
from tests.conftest import LOGS, Fleet

# One gateway and one served worker for the module's tests; the keyed ones start gateways of their own,
# and the console's walk-through a fleet on a Redis of its own (own_fleet).
pytestmark = pytest.mark.module_fleet

PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "pet"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCREENSHOT = Path(__file__).parent.parent / "docs" / "console.png"
URL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+""")


@pytest.fixture
def console() -> Iterator[TestClient]:
    """The gateway app in process, with keys, and without its lifespan: the console needs no Redis."""
    settings = GatewaySettings(api_keys="alice:ofk_" + secrets.token_urlsafe(24))
    with_keys = TestClient(build_app(settings))
    yield with_keys
    with_keys.close()


@pytest.mark.unit
def test_the_console_page_is_served_at_the_root_without_a_key(console: TestClient) -> None:
    page = console.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "<title>ortfleet console</title>" in page.text
    for name in ("console.js", "console.css", "icon.svg"):
        assert f'"/console/{name}"' in page.text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("console.js", "text/javascript; charset=utf-8"),
        ("console.css", "text/css; charset=utf-8"),
        ("icon.svg", "image/svg+xml"),
    ],
)
def test_each_console_asset_is_served_with_its_type(
    console: TestClient, name: str, content_type: str
) -> None:
    answer = console.get(f"/console/{name}")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == content_type
    assert answer.content == (ASSETS / name).read_bytes()


@pytest.mark.unit
@pytest.mark.parametrize("path", ["/console/nothing.js", "/console/..%2Fconsole.py", "/console/"])
def test_a_path_under_the_console_that_is_no_asset_is_a_404(console: TestClient, path: str) -> None:
    answer = console.get(path)
    assert answer.status_code == 404
    assert "error" in answer.json()


@pytest.mark.unit
def test_the_console_references_no_other_host() -> None:
    names = asset_names()
    assert {"index.html", "console.js", "console.css", "icon.svg"} <= set(names)
    for name in names:
        text = (ASSETS / name).read_text()
        hosts = [u for u in URL.findall(text) if u not in ("http://www.w3.org",)]
        assert not hosts, f"{name} names another host: {hosts}"
        assert "@import" not in text and "<iframe" not in text


@pytest.mark.unit
def test_the_console_assets_are_package_data() -> None:
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert 'gateway = ["console_assets/*"]' in pyproject


@pytest.mark.unit
def test_the_api_still_needs_a_key_where_the_console_does_not(console: TestClient) -> None:
    assert console.get("/v1/fleet").status_code == 401
    assert console.get("/v1/jobs").status_code == 401


async def test_the_fleet_route_shows_the_model_its_worker_and_the_load_on_a_gateway_without_keys(
    client: httpx.AsyncClient, served: str
) -> None:
    fleet = (await client.get("/v1/fleet")).json()
    assert fleet["object"] == "fleet" and fleet["load"] is True
    model = next(m for m in fleet["models"] if m["id"] == served)
    assert model["workers"] == model["ready_workers"] == 1
    assert model["queued"] == 0 and model["queued_by_class"] == {"interactive": 0, "batch": 0}
    worker = next(w for w in fleet["workers"] if w["model"] == served)
    assert worker["device"] and worker["engine_mode"] in ("continuous", "static")
    assert worker["capacity"] >= 1 and worker["in_flight"] == 0 and worker["state"] == "ready"
    assert 0 <= worker["heartbeat_age_s"] < 30
    assert isinstance(fleet["store"], list)


def test_an_ordinary_key_sees_the_fleets_shape_and_the_metrics_key_its_load_too(
    fleet: Fleet, model_name: str
) -> None:
    key, metrics_key = "ofk_" + secrets.token_urlsafe(24), "ofk_" + secrets.token_urlsafe(24)
    env = {"ORTFLEET_API_KEYS": f"bob:{key}", "ORTFLEET_METRICS_API_KEY": metrics_key}
    gateway, url = fleet.start_gateway(env)
    try:
        fleet.start_worker(model_name)
        ordinary = httpx.get(f"{url}/v1/fleet", headers={"Authorization": f"Bearer {key}"}).json()
        operator = httpx.get(f"{url}/v1/fleet", headers={"Authorization": f"Bearer {metrics_key}"}).json()
        anyone = httpx.get(f"{url}/v1/fleet")
    finally:
        gateway.terminate()
    assert anyone.status_code == 401
    assert ordinary["load"] is False and operator["load"] is True
    model = next(m for m in ordinary["models"] if m["id"] == model_name)
    assert "queued" not in model and "in_flight" not in model and model["capacity"] >= 1
    worker = next(w for w in ordinary["workers"] if w["model"] == model_name)
    assert "tokens_per_s" not in worker and "in_flight" not in worker and worker["device"]
    assert "queued" in next(m for m in operator["models"] if m["id"] == model_name)
    assert "bob" not in str(ordinary) + str(operator)


# ---- the console in a real browser ------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[Any]:
    """Debian's headless Chromium through Debian's chromedriver, keeping the page's console log."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail("Chromium is missing: apt-get install chromium chromium-driver (scripts/setup does it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    profile = tempfile.mkdtemp(prefix="ortfleet-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    chromium = webdriver.Chrome(
        service=Service(driver, log_output=str(LOGS / "chromedriver-console.log")), options=options
    )
    try:
        yield chromium
    finally:
        chromium.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(browser: Any, script: str, timeout_s: float = 60) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s, poll_frequency=0.05).until(lambda b: b.execute_script(script))


def text_of(browser: Any, element_id: str) -> str:
    text: str = browser.execute_script(f"return document.getElementById({element_id!r}).textContent")
    return text


def wait_for_text(browser: Any, element_id: str, text: str, timeout_s: float = 60) -> None:
    script = f"return document.getElementById({element_id!r}).textContent.includes({text!r})"
    wait_for(browser, script, timeout_s)


def fill(browser: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def click(browser: Any, element_id: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, element_id).click()


def go_to(browser: Any, view: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, f'nav a[data-view="{view}"]').click()
    wait_for(browser, f"return !document.getElementById('view-{view}').hidden")


@pytest.mark.slow
def test_the_console_shows_the_fleet_streams_an_answer_stops_a_generation_and_finds_a_job(
    own_fleet: Fleet, model_name: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    fleet = own_fleet
    fleet.start_worker(model_name, env={"ORTFLEET_STEP_DELAY_S": "0.05"})
    gateway = fleet.gateway_url
    browser.get(gateway + "/")

    # the fleet: the model and its worker, live
    wait_for_text(browser, "models-table", model_name)
    wait_for(browser, "return document.querySelectorAll('#workers-table tbody tr td').length > 1")
    workers = text_of(browser, "workers-table")
    assert model_name in workers and "ready" in workers and "batching" in workers + "batches"

    # the playground: a short answer, streamed, with its TTFT and rate
    go_to(browser, "playground")
    wait_for(browser, f"return document.getElementById('play-model').value === {model_name!r}")
    fill(browser, "play-user", "Say hello")
    fill(browser, "play-temperature", "0")
    fill(browser, "play-max-tokens", "24")
    assert "curl -N " + gateway + "/v1/chat/completions" in text_of(browser, "play-curl")
    assert "client.chat.completions.create(" in text_of(browser, "play-python")
    click(browser, "play-send")
    wait_for(browser, "return document.getElementById('play-status').textContent.startsWith('done')", 120)
    answer = text_of(browser, "play-answer")
    assert answer.strip()
    assert text_of(browser, "play-ttft").endswith(" s")
    assert float(text_of(browser, "play-rate")) > 0
    first_job = text_of(browser, "play-job")
    first = httpx.get(f"{gateway}/v1/jobs/{first_job}").json()
    assert first["status"] == "succeeded" and first["output"] == answer

    # structured output: a JSON schema in its box gives an answer that follows it
    fill(browser, "play-schema", json.dumps(PET))
    fill(browser, "play-max-tokens", "64")
    assert '"response_format"' in text_of(browser, "play-curl")
    click(browser, "play-send")
    wait_for(browser, "return document.getElementById('play-status').textContent.startsWith('done')", 120)
    pet = json.loads(text_of(browser, "play-answer"))
    assert set(pet) == {"name", "pet"} and pet["pet"] in ("cat", "dog")
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(SCREENSHOT))
    fill(browser, "play-schema", "")

    # tools: a required call, streamed, shown as the function's name and its arguments
    tools = [{"type": "function", "function": {"name": "time", "parameters": ZONE}}]
    fill(browser, "play-tools", json.dumps(tools))
    Select(browser.find_element(By.ID, "play-tool-choice")).select_by_value("required")
    click(browser, "play-send")
    wait_for_text(browser, "play-status", "done (tool_calls)", 120)
    call = text_of(browser, "play-answer")
    assert call.startswith("→ time(") and call.endswith(")")
    assert json.loads(call.removeprefix("→ time(")[:-1])["zone"] in ("UTC", "CET")
    fill(browser, "play-tools", "")

    # a long generation, stopped with the Stop button: its job ends cancelled
    fill(browser, "play-max-tokens", "400")
    click(browser, "play-send")
    wait_for(browser, "return document.getElementById('play-answer').textContent.length > 0", 60)
    wait_for(browser, "return document.getElementById('play-job').textContent.startsWith('job_')")
    click(browser, "play-stop")
    wait_for(browser, "return document.getElementById('play-status').textContent === 'stopped'", 60)
    stopped_job = text_of(browser, "play-job")
    stopped = httpx.get(f"{gateway}/v1/jobs/{stopped_job}", params={"wait": 30}).json()
    assert stopped["status"] == "cancelled"
    assert stopped["usage"]["completion_tokens"] < 400

    # a job submitted through the API, found by its id, its events replayed
    submitted = httpx.post(f"{gateway}/v1/jobs", json={"prompt": "Once upon", "max_tokens": 12}).json()
    done = httpx.get(f"{gateway}/v1/jobs/{submitted['id']}", params={"wait": 60}, timeout=90).json()
    assert done["status"] == "succeeded"
    go_to(browser, "jobs")
    fill(browser, "job-id", submitted["id"])
    browser.find_element(By.CSS_SELECTOR, "#job-find button[type=submit]").click()
    wait_for(browser, "return !document.getElementById('job-detail').hidden")
    assert submitted["id"] in text_of(browser, "job-detail-title")
    assert "succeeded" in text_of(browser, "job-facts")
    assert text_of(browser, "job-output") == done["output"]
    click(browser, "job-replay-all")
    wait_for(browser, "return document.querySelector('#job-events .ev-done') !== null", 30)
    assert text_of(browser, "job-replayed") == done["output"]
    click(browser, "jobs-recent")
    wait_for_text(browser, "jobs-table", stopped_job)

    # phone width: nothing wider than the screen but the tables' own scrolling boxes
    browser.set_window_size(390, 844)
    wait_for(browser, "return window.innerWidth < 500", 10)  # resized from 1280
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")

    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe


@pytest.mark.slow
def test_the_console_asks_a_keyed_gateway_for_a_key_and_keeps_it_in_the_tab_only(
    fleet: Fleet, model_name: str, browser: Any
) -> None:
    from selenium.webdriver.common.keys import Keys

    key = "ofk_" + secrets.token_urlsafe(24)
    name = "carol-" + secrets.token_hex(4)  # a key of its own: other tests' jobs share the session's Redis
    gateway, url = fleet.start_gateway({"ORTFLEET_API_KEYS": f"{name}:{key}"})
    try:
        fleet.start_worker(model_name)
        browser.get(url + "/")
        wait_for(browser, "return !document.getElementById('key-panel').hidden")
        assert browser.execute_script("return document.activeElement.id") == "key-input"
        fill(browser, "key-input", key + Keys.ENTER)
        wait_for_text(browser, "models-table", model_name)
        assert browser.execute_script("return !document.getElementById('fleet-load-hidden').hidden")
        assert browser.execute_script("return sessionStorage.getItem('ortfleet.key')") == key
        assert browser.execute_script("return localStorage.length + document.cookie.length") == 0
        go_to(browser, "jobs")
        click(browser, "jobs-recent")
        wait_for_text(browser, "jobs-table", "no job for this key")
    finally:
        gateway.terminate()
    # the first reads, before the key was given, were refused: the browser logs those, and nothing else
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not severe, severe
