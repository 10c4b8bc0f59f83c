"""deploy/: the compose file, its Prometheus config and the Dockerfile, checked without a Docker engine:
every image, command, flag, mounted path and setting they name exists in this repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError

from common.gateway_settings import GatewaySettings
from common.worker_settings import WorkerSettings
from tests.conftest import Fleet, RedisServer
from worker.engines.device import host_gpu_index

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PYPROJECT_SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SETTINGS = {
    "ortfleet-gateway": GatewaySettings,
    "ortfleet-worker": WorkerSettings,
    "ortfleet": WorkerSettings,  # `ortfleet model default` reads the shared settings (the model cache)
}


def ours(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("ortfleet:")


def dockerfile_targets() -> set[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE | re.IGNORECASE))


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[dict[str, Any]] = reservations.get("devices", [])
    return devices


@pytest.mark.unit
def test_compose_has_the_fleet_topology() -> None:
    assert {"redis", "gateway", "worker-cpu", "prometheus", "grafana"} <= set(SERVICES)
    gpu_workers = [name for name, service in SERVICES.items() if gpu_devices(service)]
    assert len(gpu_workers) >= 2, "one worker per GPU"
    assert all(name.startswith("worker-") for name in gpu_workers)


@pytest.mark.unit
def test_images_are_built_from_our_dockerfile_or_pinned() -> None:
    targets = dockerfile_targets()
    assert {"cpu", "cuda"} <= targets
    built: dict[str, str] = {}
    for name, service in SERVICES.items():
        image = service["image"]
        if ours(service):
            build = service["build"]
            assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile", name
            assert build["target"] in targets, name
            assert built.setdefault(image, build["target"]) == build["target"], f"{image} built two ways"
            assert image == f"ortfleet:{build['target']}", name
        else:
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    assert built["ortfleet:cpu"] == "cpu" and built["ortfleet:cuda"] == "cuda"


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if ours(s)])
def test_commands_and_their_flags_exist(name: str) -> None:
    command = SERVICES[name]["command"]
    script = command[0]
    assert script in PYPROJECT_SCRIPTS, f"{name}: {script} is not one of our console scripts"
    first_flag = next((i for i, w in enumerate(command) if w.startswith("-")), len(command))
    subcommands = command[1:first_flag]
    flags = [w.split("=", 1)[0] for w in command[1:] if w.startswith("--")]
    # The console script's entry point, run from this checkout whatever `pip install -e` points at.
    module, function = PYPROJECT_SCRIPTS[script].split(":")
    entry_point = f"import sys; sys.argv[0] = {script!r}; from {module} import {function}; {function}()"
    help_text = subprocess.run(
        [sys.executable, "-c", entry_point, *subcommands, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    ).stdout
    for flag in flags:
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{name}: {script} has no {flag}"


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if ours(s)])
@pytest.mark.unit
def test_environment_names_only_settings_that_exist_with_valid_values(name: str) -> None:
    service = SERVICES[name]
    settings_class = SETTINGS[service["command"][0]]
    environment: dict[str, str] = service.get("environment", {})
    fields = {}
    for variable, raw in environment.items():
        assert variable.startswith("ORTFLEET_"), f"{name}: {variable}"
        field = variable.removeprefix("ORTFLEET_").lower()
        assert field in settings_class.model_fields, f"{name}: {variable} is not a setting"
        fields[field] = str(raw)
    try:
        settings_class.model_validate(fields)
    except ValidationError as e:
        pytest.fail(f"{name}: {e}")


@pytest.mark.unit
def test_mounted_paths_exist_in_the_repo_and_named_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes", {}))
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert target.startswith("/"), f"{name}: {volume}"
            if source.startswith((".", "/")):
                assert (DEPLOY / source).resolve().exists(), f"{name}: {source} is not in the repo"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


@pytest.mark.unit
def test_each_gpu_worker_reserves_a_distinct_gpu() -> None:
    reserved: list[str] = []
    for name, service in SERVICES.items():
        devices = gpu_devices(service)
        if not devices:
            continue
        [device] = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert len(device["device_ids"]) == 1, f"{name}: one GPU per worker"
        reserved += device["device_ids"]
        command = service["command"]
        # The container sees its one GPU as cuda:0 (its metrics still say the host's index, see below).
        assert command[command.index("--device") + 1] == "cuda:0", name
        assert service["image"] == "ortfleet:cuda", name
    assert len(reserved) == len(set(reserved)) >= 2, reserved


@pytest.mark.unit
def test_a_worker_in_a_container_labels_its_metrics_with_the_hosts_gpu_index() -> None:
    assert host_gpu_index(0, {"NVIDIA_VISIBLE_DEVICES": "3"}) == "3"
    assert host_gpu_index(1, {"CUDA_VISIBLE_DEVICES": "2,5"}) == "5"
    assert host_gpu_index(0, {"CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert host_gpu_index(0, {"NVIDIA_VISIBLE_DEVICES": "all"}) == "0"
    assert host_gpu_index(2, {}) == "2"


@pytest.mark.unit
def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = SERVICES["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["healthcheck"]["test"]


@pytest.mark.unit
def test_the_gateway_scales_behind_a_health_check() -> None:
    gateway = SERVICES["gateway"]
    assert "container_name" not in gateway  # a fixed name would forbid replicas
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    for mapping in gateway.get("ports", []):
        host = str(mapping).rsplit(":", 1)[0]
        assert "-" in host, f"{mapping}: replicas need a range of host ports"


def test_prometheus_config_is_valid_and_finds_every_gateway_and_worker() -> None:
    prometheus = SERVICES["prometheus"]
    [config_mount] = [v for v in prometheus["volumes"] if v.split(":")[1] == "/etc/prometheus/prometheus.yml"]
    config_file = (DEPLOY / config_mount.split(":")[0]).resolve()
    assert config_file == DEPLOY / "prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]

    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (scripts/setup installs Debian's prometheus package)"
    checked = subprocess.run([promtool, "check", "config", str(config_file)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    config = yaml.safe_load(config_file.read_text())
    found: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            found.update(dict.fromkeys(sd["names"], sd["port"]))
    assert found["gateway"] == 8000
    for name, service in SERVICES.items():
        if name.startswith("worker-"):
            command = service["command"]
            assert found.get(name) == int(command[command.index("--metrics-port") + 1]), name
            assert service["environment"]["ORTFLEET_METRICS_HOST"] == "0.0.0.0", name


@pytest.mark.unit
def test_grafana_is_provisioned_from_the_repo_with_the_dashboard_and_its_datasource() -> None:
    grafana = SERVICES["grafana"]
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == ROOT / "grafana" / "provisioning"
    provisioning = ROOT / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    [datasource] = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "ortfleet.yaml").read_text())
    [provider] = providers["providers"]
    dashboards = mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "ortfleet.json").read_text())
    uids = {
        target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    }
    assert uids == {datasource["uid"]}
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/ortfleet.json"


@pytest.mark.unit
def test_dockerfile_copies_only_what_exists() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY\s+(?!--from)(.+)\s+\S+$", text, flags=re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
    for script in re.findall(r'CMD \["([\w-]+)"', text):
        assert script in PYPROJECT_SCRIPTS, script
    assert os.path.exists(DEPLOY / "Dockerfile.dockerignore")


def test_the_compose_gateway_starts_with_the_command_and_environment_compose_gives_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    service = SERVICES["gateway"]
    command = service["command"]
    environment = {name: str(value) for name, value in service["environment"].items()}
    fleet = Fleet(redis_server.url, tmp_path)  # its Redis URL replaces compose's, which names a container
    try:
        _, url = fleet.start_gateway(environment, host=command[command.index("--host") + 1])
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        fleet.stop_all()


@pytest.mark.unit
def test_the_compose_gateway_is_published_on_loopback_only_while_it_has_no_api_keys() -> None:
    service = SERVICES["gateway"]
    keyed = {"ORTFLEET_API_KEYS", "ORTFLEET_API_KEYS_FILE"} & set(service["environment"])
    if not keyed:
        assert all(str(port).startswith("127.0.0.1:") for port in service["ports"]), service["ports"]
