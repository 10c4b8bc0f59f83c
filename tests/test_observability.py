"""Prometheus metrics on a real fleet: a real Prometheus scrapes a gateway and two workers, and every query
of every panel of the Grafana dashboard returns data; queue depth comes from Redis on every gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ortfleet.fleet.processes import free_port, stop
from tests.conftest import LOGS, Fleet, RedisServer
from tests.jobs_client import read_events, submit, wait_done
from tests.test_cli import ortfleet_up
from tests.test_lora import write_adapter
from worker.engines.batcher.engine import DEFAULT_SLOTS

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "ortfleet.json"
# What Grafana puts in place of the dashboard's variables: every model, and a rate window that holds
# enough 1 s scrapes.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model": ".*"}


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    async def query(self, http: httpx.AsyncClient, promql: str) -> list[dict[str, Any]]:
        reply = await http.get(f"{self.url}/api/v1/query", params={"query": promql})
        body = reply.json()
        assert body["status"] == "success", (promql, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


StartPrometheus = Callable[[dict[str, Any]], Prometheus]


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[StartPrometheus]:
    """Starts Debian's prometheus on a free port with the given config and its own storage in tmp."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (scripts/setup installs Debian's package)"
    started: list[Prometheus] = []

    def start(config: dict[str, Any]) -> Prometheus:
        config_file = tmp_path / f"prometheus-{len(started)}.yml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        port = free_port()
        log = (LOGS / f"prometheus-{port}.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / f'tsdb-{len(started)}'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        server = Prometheus(f"http://127.0.0.1:{port}", process)
        started.append(server)
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"prometheus exited with code {process.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                    return server
            assert time.monotonic() < deadline, "prometheus was not ready within 30 s"
            time.sleep(0.05)

    yield start
    for server in started:
        stop(server.process)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables filled in) for every query of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: a Grafana variable the test does not know: {expr}"
            queries.append((panel["title"], expr))
    return queries


@contextlib.asynccontextmanager
async def traffic(client: httpx.AsyncClient, *models: str, lanes: int = 3) -> AsyncIterator[None]:
    """Jobs streamed over SSE, a cancelled job and a 404, over and over until the block ends; lane i names
    the i-th model (modulo their number)."""
    stopping = asyncio.Event()

    async def lane(index: int) -> None:
        model = models[index % len(models)]
        while not stopping.is_set():
            job = await submit(client, {"model": model, "prompt": f"Hello {index}", "max_tokens": 24})
            await read_events(client, job["id"])
            doomed = await submit(client, {"model": model, "prompt": "Bye", "max_tokens": 200})
            await client.delete(f"/v1/jobs/{doomed['id']}")
            assert (await client.get("/v1/jobs/job_missing")).status_code == 404

    tasks = [asyncio.create_task(lane(i)) for i in range(lanes)]
    try:
        yield
    finally:
        stopping.set()
        await asyncio.gather(*tasks)


async def wait_for_targets(prometheus: Prometheus, http: httpx.AsyncClient, count: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        targets = (await http.get(f"{prometheus.url}/api/v1/targets")).json()["data"]["activeTargets"]
        if sum(t["health"] == "up" for t in targets) >= count:
            return
        assert time.monotonic() < deadline, f"targets not up within 30 s: {targets}"
        await asyncio.sleep(0.2)


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def shows_adapters(result: list[dict[str, Any]], adapter: str) -> bool:
    """A per-adapter panel's series: the adapter's own, counting, and the model's own, named (model)."""
    rates = {series["metric"].get("adapter"): float(series["value"][1]) for series in result}
    return rates.get(adapter, 0.0) > 0 and "(model)" in rates


async def test_every_dashboard_panel_shows_data_from_a_running_fleet(
    fleet: Fleet,
    client: httpx.AsyncClient,
    model_name: str,
    start_prometheus: StartPrometheus,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    adapter = f"{model_name}-lora"
    lora = f"{adapter}={write_adapter(tmp_path / 'lora', tiny_model)}"
    worker_ports = [free_port(), free_port()]
    for port in worker_ports:
        fleet.start_worker(model_name, "--metrics-port", str(port), "--lora", lora)
    prometheus = start_prometheus(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "ortfleet-gateway",
                    "static_configs": [{"targets": [fleet.gateway_url.removeprefix("http://")]}],
                },
                {
                    "job_name": "ortfleet-worker",
                    "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in worker_ports]}],
                },
            ],
        }
    )
    queries = dashboard_queries()
    assert len(queries) >= 20

    async with httpx.AsyncClient(timeout=10) as http:
        await wait_for_targets(prometheus, http, 3)
        pending = dict(enumerate(queries))
        async with traffic(client, model_name, adapter):
            deadline = time.monotonic() + 90
            while pending and time.monotonic() < deadline:
                for key, (title, promql) in list(pending.items()):
                    result = await prometheus.query(http, promql)
                    if shows_adapters(result, adapter) if "LoRA adapter" in title else has_data(result):
                        del pending[key]
                await asyncio.sleep(0.5)

    assert not pending, "panels without data:\n" + "\n".join(f"{t}: {q}" for t, q in pending.values())


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def value(text: str, name: str, **labels: str) -> float | None:
    found = [v for sample_labels, v in samples(text, name) if labels.items() <= sample_labels.items()]
    return sum(found) if found else None


async def test_every_gateway_reports_the_queue_depth_held_in_redis(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    _second, second_url = fleet.start_gateway()
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 4}
    worker.pause()  # jobs stay queued (well within the heartbeat's lifetime)
    try:
        jobs = [await submit(client, body) for _ in range(3)]
        for url in (fleet.gateway_url, second_url):
            text = (await client.get(f"{url}/metrics")).text
            assert value(text, "ortfleet_num_requests_waiting", model=model_name) == 3, url
            assert value(text, "ortfleet_queue_oldest_wait_seconds", model=model_name) is not None
    finally:
        worker.resume()
    for job in jobs:
        assert (await wait_done(client, job["id"]))["status"] == "succeeded"
    text = (await client.get(f"{second_url}/metrics")).text
    assert value(text, "ortfleet_num_requests_waiting", model=model_name) == 0
    assert value(text, "ortfleet_workers_live", model=model_name) == 1


async def test_http_metrics_label_routes_by_template_and_count_jobs_and_streams(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    fleet.start_worker(model_name)
    assert (await client.get("/v1/jobs/job_no_such_thing")).status_code == 404
    job = await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4})
    await read_events(client, job["id"])

    text = (await client.get("/metrics")).text

    routes = [labels for labels, _ in samples(text, "ortfleet_http_requests_total")]
    assert {"route": "/v1/jobs/{job_id}", "method": "GET", "status": "404"} in routes
    assert not [labels for labels in routes if "job_no_such_thing" in labels["route"]]
    assert value(text, "ortfleet_http_requests_total", route="/v1/jobs", status="202") is not None
    assert value(text, "ortfleet_jobs_submitted_total", model=model_name) == 1
    assert value(text, "ortfleet_sse_streams_active", route="/v1/jobs/{job_id}/events") == 0
    durations = value(text, "ortfleet_http_request_duration_seconds_count", route="/v1/jobs/{job_id}/events")
    assert durations == 1
    # The gateway collects its startup heap once, in full, before it serves: that pause is on record.
    full_collections = value(text, "ortfleet_gc_pause_seconds_count", generation="2")
    assert full_collections is not None and full_collections >= 1
    assert (value(text, "ortfleet_gc_pause_seconds_sum") or 0) > 0


async def test_a_worker_exposes_its_latencies_tokens_and_load_labelled_by_model_and_device(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    port = free_port()
    fleet.start_worker(model_name, "--metrics-port", str(port))
    jobs = [await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 8}) for _ in range(2)]
    for job in jobs:
        assert (await wait_done(client, job["id"]))["usage"]["completion_tokens"] == 8
    url = f"http://127.0.0.1:{port}/metrics"
    labels = {"model": model_name, "device": "cpu", "gpu": ""}

    deadline = time.monotonic() + 10  # generated tokens are read from the heartbeat's snapshot
    while value(text := (await client.get(url)).text, "ortfleet_generation_tokens_total", **labels) != 16:
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.2)

    assert value(text, "ortfleet_time_to_first_token_seconds_count", **labels) == 2
    assert value(text, "ortfleet_inter_token_latency_seconds_count", **labels) == 14
    assert value(text, "ortfleet_e2e_request_latency_seconds_count", **labels) == 2
    assert value(text, "ortfleet_request_queue_time_seconds_count", **labels) == 2
    assert (value(text, "ortfleet_prompt_tokens_total", **labels) or 0) > 0
    assert value(text, "ortfleet_jobs_finished_total", status="succeeded", **labels) == 2
    assert value(text, "ortfleet_request_success_total", finished_reason="length", **labels) == 2
    assert value(text, "ortfleet_engine_capacity", **labels) == DEFAULT_SLOTS  # the batcher's default
    assert value(text, "ortfleet_num_requests_running", **labels) == 0
    [(info, _)] = samples(text, "ortfleet_worker_info")
    assert info["model"] == model_name and info["device"] == "cpu" and info["batching"] == "continuous"
    assert info["onnxruntime_genai_version"] != "unknown"


def test_up_gives_each_worker_its_own_metrics_port_listed_for_prometheus(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    sd_file = tmp_path / "targets.json"
    with ortfleet_up(
        tmp_path / "up.log",
        "--model", str(tiny_model), "--workers", "2", "--port", str(port), "--metrics-sd", str(sd_file),
    ) as up:  # fmt: skip
        printed = up.read_until("curl -N", timeout_s=120)
        groups = {group["labels"]["role"]: group["targets"] for group in json.loads(sd_file.read_text())}
        assert groups["gateway"] == [f"127.0.0.1:{port}"]
        assert len(set(groups["worker"])) == 2
        for target in groups["worker"]:
            assert f"http://{target}/metrics" in printed
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
            assert value(text, "ortfleet_engine_capacity", model=tiny_model.name) == DEFAULT_SLOTS
        assert "ortfleet status --redis-url redis://127.0.0.1:" in printed


@pytest.mark.parametrize("per_key", [True, False])
def test_a_gateway_labels_queue_and_served_tokens_by_key_only_when_told_to(
    redis_server: RedisServer, tiny_model: Path, per_key: bool
) -> None:
    fleet = Fleet(redis_server.url, tiny_model)
    try:
        _, url = fleet.start_gateway({"ORTFLEET_METRICS_PER_KEY": str(per_key).lower()})
        names = {family.name for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        assert ("ortfleet_queued_jobs_by_key" in names) is per_key
        assert ("ortfleet_served_tokens_by_key" in names) is per_key
        assert "ortfleet_served_tokens" in names
    finally:
        fleet.stop_all()
