"""deploy/kubernetes: every overlay renders with `kubectl kustomize` (offline) and every object it renders
validates against the Kubernetes schemas (kubernetes-validate), KEDA's and the Prometheus Operator's CRD
schemas (tests/fixtures); the settings, commands and signals the manifests use are ortfleet's own, the
preStop hook drains a real worker, and the KEDA trigger's query, asked of a real Prometheus scraping a
real fleet, returns the model's queue depth."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.gateway_settings import GatewaySettings
from common.redis_url import parse_sentinel_url
from common.settings import FleetSettings
from common.worker_settings import WorkerSettings
from tests.conftest import Fleet
from tests.jobs_client import read_events, submit, wait_done
from tests.test_observability import StartPrometheus, start_prometheus, wait_for_targets  # noqa: F401 (a fixture)

ROOT = Path(__file__).parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(path.parent.name for path in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
FIXTURES = Path(__file__).parent / "fixtures"
KUBERNETES_VERSION = "1.32.0"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): FIXTURES / "keda-scaledobject-v2.20.1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): FIXTURES
    / "prometheus-operator-servicemonitor-v0.93.0.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): FIXTURES / "prometheus-operator-podmonitor-v0.93.0.json",
}
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SETTINGS = {
    "ortfleet-gateway": GatewaySettings,
    "ortfleet-worker": WorkerSettings,
    "ortfleet": WorkerSettings,
}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed"
)


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    output = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(output) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(overlay) if doc["kind"] == kind]


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    found: list[dict[str, Any]] = spec["containers"] + spec.get("initContainers", [])
    return found


def env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def workers(overlay: str) -> list[dict[str, Any]]:
    return [d for d in objects(overlay, "Deployment") if d["metadata"]["name"].startswith("worker-")]


def closed(schema: Any) -> Any:
    """The CRD schema as the API server applies it: fields it does not declare are errors (the API server
    would drop them silently), unless it keeps unknown fields."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        result.setdefault("additionalProperties", False)
    return result


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    fixture = json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())
    schema = closed(fixture["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_and_crd_schemas(overlay: str) -> None:
    docs = render(overlay)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds
    assert {"ScaledObject", "ServiceMonitor", "ConfigMap"} <= kinds
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if key in CRD_SCHEMAS:
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in crd_validator(*key).iter_errors(doc)]
            assert not errors, f"{overlay}: {where}: {errors}"
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{overlay}: {where}: {e.message} at {list(e.path)}")


@pytest.mark.unit
def test_a_crd_schema_check_catches_a_misspelt_field() -> None:
    scaled = objects("cpu", "ScaledObject")[0]
    broken = {**scaled, "spec": {**scaled["spec"], "minReplicas": 0}}
    assert not list(crd_validator("keda.sh/v1alpha1", "ScaledObject").iter_errors(scaled))
    assert list(crd_validator("keda.sh/v1alpha1", "ScaledObject").iter_errors(broken))


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.unit
def test_every_command_and_setting_in_the_manifests_is_ortfleets(overlay: str) -> None:
    config = next(c for c in objects(overlay, "ConfigMap") if c["metadata"]["name"] == "ortfleet")
    every_setting = set(GatewaySettings.model_fields) | set(WorkerSettings.model_fields)
    for name in config["data"]:
        assert name.removeprefix("ORTFLEET_").lower() in every_setting, f"{name} is no ortfleet setting"
    for deployment in objects(overlay, "Deployment"):
        for container in containers(deployment):
            program = container["command"][0]
            assert program in SCRIPTS, f"{container['name']}: {program} is not an ortfleet command"
            fields = SETTINGS[program].model_fields
            for name in env(container):
                if name.startswith("ORTFLEET_"):
                    field = name.removeprefix("ORTFLEET_").lower()
                    assert field in fields, f"{container['name']}: {name} is not a setting of {program}"
            if container["name"] == "gateway":
                GatewaySettings(**{k.removeprefix("ORTFLEET_").lower(): v for k, v in config["data"].items()})


@pytest.mark.parametrize("overlay", [overlay for overlay in OVERLAYS if overlay != "gpu-cluster"])
@pytest.mark.unit
def test_processes_follow_the_sentinels_of_the_referenced_redis_chart(overlay: str) -> None:
    values = yaml.safe_load((KUBERNETES / "redis" / "values.yaml").read_text())
    assert values["architecture"] == "replication" and values["auth"]["enabled"]
    assert values["sentinel"]["enabled"] and values["replica"]["replicaCount"] >= 3
    for deployment in objects(overlay, "Deployment"):
        main = deployment["spec"]["template"]["spec"]["containers"][0]
        url = parse_sentinel_url(env(main)["ORTFLEET_REDIS_URL"].replace("$(REDIS_PASSWORD)", "secret"))
        assert url.sentinels == (("ortfleet-redis", 26379),)  # the chart's Service, its Sentinel port
        assert url.service == values["sentinel"]["masterSet"]
        assert url.password == url.sentinel_password == "secret"  # the chart's one password, auth.sentinel
        names = [item["name"] for item in main["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("ORTFLEET_REDIS_URL"), "$(VAR) needs VAR first"


@pytest.mark.unit
def test_the_gpu_overlay_gives_each_worker_one_gpu_and_the_cpu_overlay_none() -> None:
    for deployment in workers("gpu"):
        worker = deployment["spec"]["template"]["spec"]["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert worker["command"][worker["command"].index("--device") + 1] == "cuda:0"
        assert worker["image"] == "ortfleet:cuda"
    for deployment in workers("cpu"):
        worker = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in json.dumps(worker["resources"])
        assert worker["command"][worker["command"].index("--device") + 1] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.unit
def test_each_model_has_its_own_workers_budget_and_scaler(overlay: str) -> None:
    deployments = workers(overlay)
    assert deployments
    budgets = {p["metadata"]["name"]: p for p in objects(overlay, "PodDisruptionBudget")}
    scalers = {s["spec"]["scaleTargetRef"]["name"]: s for s in objects(overlay, "ScaledObject")}
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        model = selector["ortfleet.dev/model"]
        assert budgets[name]["spec"]["selector"]["matchLabels"] == selector
        query = scalers[name]["spec"]["triggers"][0]["metadata"]["query"]
        assert set(re.findall(r'model="([^"]+)"', query)) == {model}
        served = served_model(deployment["spec"]["template"]["spec"]["containers"][0])
        assert served == model, f"{name} serves {served}, its scaler watches {model}"
    assert "gateway" in budgets


def served_model(container: dict[str, Any]) -> str:
    """The name a worker container serves: --name, else its --model folder's name, else the default."""
    from common.model_folder import DEFAULT_MODEL_NAME

    command = container["command"]
    for flag in ("--name", "--model"):
        if flag in command:
            return Path(command[command.index(flag) + 1]).name
    return DEFAULT_MODEL_NAME


def settings_of(main: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[FleetSettings, str]:
    """The settings a container's process reads (its password "secret"), and its shard map as given."""
    names = [item["name"] for item in main["env"]]
    for name in ("ORTFLEET_REDIS_URL", "ORTFLEET_REDIS_SHARDS"):
        assert names.index("REDIS_PASSWORD") < names.index(name), "$(VAR) needs VAR first"
    values = {k: v.replace("$(REDIS_PASSWORD)", "secret") for k, v in env(main).items()}
    for name in ("ORTFLEET_REDIS_URL", "ORTFLEET_REDIS_SHARDS"):  # read as the process reads them
        monkeypatch.setenv(name, values[name])
    return FleetSettings(), values["ORTFLEET_REDIS_SHARDS"]


@pytest.mark.unit
def test_the_stores_overlay_spreads_the_gpu_model_over_three_sentinel_backed_stores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = yaml.safe_load((KUBERNETES / "redis" / "values.yaml").read_text())
    store = yaml.safe_load((KUBERNETES / "redis" / "values-store.yaml").read_text())
    # The further releases open with the first release's password, the one every container reads.
    assert store["auth"] == {
        "existingSecret": "ortfleet-redis",
        "existingSecretPasswordKey": "redis-password",
    }
    models = {served_model(d["spec"]["template"]["spec"]["containers"][0]) for d in workers("gpu-stores")}
    assert models == {served_model(d["spec"]["template"]["spec"]["containers"][0]) for d in workers("gpu")}
    maps = set()
    for deployment in objects("gpu-stores", "Deployment"):
        main = deployment["spec"]["template"]["spec"]["containers"][0]
        settings, shards = settings_of(main, monkeypatch)
        maps.add(shards)
        for model in models:
            urls = [parse_sentinel_url(url) for url in [store.url for store in settings.stores_for(model)]]
            assert [url.sentinels for url in urls] == [
                (("ortfleet-redis", 26379),),
                (("ortfleet-redis-store-2", 26379),),
                (("ortfleet-redis-store-3", 26379),),
            ]
            assert {url.service for url in urls} == {base["sentinel"]["masterSet"]}
            assert all(url.password == url.sentinel_password == "secret" for url in urls)
    assert len(maps) == 1, "every gateway and worker must get the same map"
    # At least one worker per store, so that no store is left without one.
    assert all(s["spec"]["minReplicaCount"] >= 3 for s in objects("gpu-stores", "ScaledObject"))
    assert all(
        "ORTFLEET_REDIS_SHARDS" not in env(d["spec"]["template"]["spec"]["containers"][0])
        for d in objects("gpu", "Deployment")
    )


@pytest.mark.unit
def test_scale_to_zero_is_an_option_of_its_own() -> None:
    assert all(s["spec"]["minReplicaCount"] >= 1 for s in objects("gpu", "ScaledObject"))
    assert all(s["spec"]["minReplicaCount"] == 0 for s in objects("gpu-scale-to-zero", "ScaledObject"))
    gateway = next(
        d for d in objects("gpu-scale-to-zero", "Deployment") if d["metadata"]["name"] == "gateway"
    )
    probe = gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["path"] == "/healthz", "with no worker the gateway must still take jobs"
    config = next(c for c in objects("gpu-scale-to-zero", "ConfigMap") if c["metadata"]["name"] == "ortfleet")
    assert config["data"]["ORTFLEET_QUEUE_WITHOUT_WORKERS"] == "true"


async def test_with_workers_scaled_to_zero_the_gateway_queues_jobs_until_a_worker_starts(
    fleet: Fleet, model_name: str
) -> None:
    worker = fleet.start_worker(model_name)
    _, url = fleet.start_gateway({"ORTFLEET_QUEUE_WITHOUT_WORKERS": "true"})
    assert worker.terminate() == 0
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as http:
        # The gateway's own registry read, so that its view (which may be 0.5 s old) holds the departure.
        models = (await http.get(f"{fleet.gateway_url}/v1/models")).json()["data"]
        assert model_name not in [m["id"] for m in models]
        refused = await http.post(f"{fleet.gateway_url}/v1/jobs", json=body)
        assert refused.status_code == 503, "by default a model with no live worker is refused"
        queued = await http.post(f"{url}/v1/jobs", json=body)
        assert queued.status_code == 202, queued.text
        fleet.start_worker(model_name, wait=False)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert (await wait_done(client, queued.json()["id"]))["status"] == "succeeded"


@pytest.mark.unit
def test_the_dashboard_config_map_is_the_grafana_dashboard() -> None:
    dashboard = (ROOT / "grafana" / "dashboards" / "ortfleet.json").read_text()
    maps = [c for c in objects("cpu", "ConfigMap") if "ortfleet.json" in c.get("data", {})]
    assert len(maps) == 1 and maps[0]["data"]["ortfleet.json"] == dashboard
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.unit
def test_termination_grace_covers_the_workers_shutdown_grace(overlay: str) -> None:
    for deployment in workers(overlay):
        spec = deployment["spec"]["template"]["spec"]
        worker = spec["containers"][0]
        grace = float(env(worker)["ORTFLEET_SHUTDOWN_GRACE_S"])
        assert spec["terminationGracePeriodSeconds"] >= grace + 15, "grace, then the hand-back"
        assert worker["lifecycle"]["preStop"]["exec"]["command"][:2] == ["/bin/sh", "-c"]


async def test_the_prestop_hook_drains_a_real_worker_letting_its_running_job_finish(
    fleet: Fleet, client: httpx.AsyncClient, model_name: str
) -> None:
    hook = workers("cpu")[0]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]
    script = hook["command"][2]
    # In the Pod the worker is PID 1 (exec-form command, no init); here the hook targets our worker.
    assert re.findall(r"kill -([A-Z]+) 1\b", script) == ["TERM"], "SIGTERM is what starts a worker's drain"
    worker = fleet.start_worker(model_name, env={"ORTFLEET_SHUTDOWN_GRACE_S": "30"})
    job = await submit(client, {"model": model_name, "prompt": "Hello", "max_tokens": 48})
    connected = asyncio.Event()
    reader = asyncio.create_task(read_events(client, job["id"], connected=connected))
    await asyncio.wait_for(connected.wait(), 30)
    started = time.monotonic()
    hook_run = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", re.sub(r"(kill -\w+) 1\b", rf"\1 {worker.pid}", script)
    )
    assert await asyncio.wait_for(hook_run.wait(), 60) == 0
    assert not worker.alive(), "the hook returns once the worker has exited"
    assert time.monotonic() - started < 45
    done = await wait_done(client, job["id"])
    assert done["status"] == "succeeded", "the running job finished within the grace, on this worker"
    events = await reader
    assert events[-1].event == "done"


async def test_the_keda_trigger_query_returns_the_queue_depth_of_a_real_fleet(
    fleet: Fleet,
    client: httpx.AsyncClient,
    model_name: str,
    start_prometheus: StartPrometheus,  # noqa: F811 (the fixture)
) -> None:
    scaler = objects("cpu", "ScaledObject")[0]
    template_model = served_model(workers("cpu")[0]["spec"]["template"]["spec"]["containers"][0])
    query = scaler["spec"]["triggers"][0]["metadata"]["query"].replace(template_model, model_name)
    _second, second_url = fleet.start_gateway()  # two gateways report the same depth: it counts once
    worker = fleet.start_worker(model_name)
    prometheus = start_prometheus(
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "ortfleet-gateway",
                    "static_configs": [
                        {"targets": [u.removeprefix("http://") for u in (fleet.gateway_url, second_url)]}
                    ],
                },
            ],
        }
    )
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_for_targets(prometheus, http, 2)
        assert await scalar(prometheus, http, query) == 0
        worker.pause()
        try:
            jobs = [
                await submit(client, {"model": model_name, "prompt": "Hi", "max_tokens": 4}) for _ in range(3)
            ]
            assert await eventually(prometheus, http, query, 3.0) == 3.0
        finally:
            worker.resume()
        for job in jobs:
            await wait_done(client, job["id"])
        assert await eventually(prometheus, http, query, 0.0) == 0.0


async def scalar(prometheus: Any, http: httpx.AsyncClient, query: str) -> float:
    result = await prometheus.query(http, query)
    assert len(result) == 1, f"KEDA needs exactly one series: {result}"
    return float(result[0]["value"][1])


async def eventually(prometheus: Any, http: httpx.AsyncClient, query: str, expected: float) -> float:
    deadline = time.monotonic() + 30
    # Prometheus has no push: poll it.
    while (value := await scalar(prometheus, http, query)) != expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.5)
    return value


@pytest.mark.unit
def test_the_cluster_overlay_spreads_the_gpu_model_over_three_stores_of_the_referenced_cluster_chart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = yaml.safe_load((KUBERNETES / "redis" / "values-cluster.yaml").read_text())
    assert values["cluster"] == {"nodes": 6, "replicas": 1}  # three primaries, a replica each
    assert (
        values["existingSecret"] == "ortfleet-redis"
        and values["existingSecretPasswordKey"] == "redis-password"
    )
    assert "maxmemory-policy noeviction" in values["redis"]["configmap"]
    models = {served_model(d["spec"]["template"]["spec"]["containers"][0]) for d in workers("gpu-cluster")}
    maps = set()
    for deployment in objects("gpu-cluster", "Deployment"):
        main = deployment["spec"]["template"]["spec"]["containers"][0]
        settings, shards = settings_of(main, monkeypatch)
        assert settings.redis_url.get_secret_value() == "redis://:secret@ortfleet-redis-cluster:6379/0"
        maps.add(shards)
        for model in models:
            stores = settings.stores_for(model)
            assert len(stores) == 3 and all(store.cluster for store in stores)
            assert len({store.keys.tag for store in stores}) == 3
    assert len(maps) == 1, "every gateway and worker must get the same map"
    assert all(s["spec"]["minReplicaCount"] >= 3 for s in objects("gpu-cluster", "ScaledObject"))
