"""ORTFLEET_CUDA_GRAPH: the CUDA provider options the worker loads a model with, for each setting value,
on the CPU and on CUDA, with and without paged attention. No GPU: the config is built, not loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest

from common.worker_settings import WorkerSettings
from worker.engines import genai_config
from worker.engines.device import Device
from worker.engines.genai_config import cuda_provider_options, load_config

pytestmark = pytest.mark.unit

CUDA = Device("cuda", 1)
CPU = Device("cpu")


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
@pytest.mark.parametrize("paged", [True, False])
def test_the_cpu_gets_no_cuda_provider_whatever_the_setting(setting: str, paged: bool) -> None:
    assert cuda_provider_options(CPU, setting, paged) == {}


@pytest.mark.parametrize(
    ("setting", "paged", "graph"),
    [
        ("auto", True, "1"),
        ("auto", False, "0"),
        ("on", True, "1"),
        ("on", False, "1"),
        ("off", True, "0"),
        ("off", False, "0"),
    ],
)
def test_cuda_graphs_follow_the_setting_and_auto_turns_them_on_for_paged_models(
    setting: str, paged: bool, graph: str
) -> None:
    assert cuda_provider_options(CUDA, setting, paged) == {"device_id": "1", "enable_cuda_graph": graph}


def test_the_first_gpu_is_device_0() -> None:
    assert cuda_provider_options(Device("cuda"), "auto", True)["device_id"] == "0"


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, on or off"):
        cuda_provider_options(CUDA, "yes", True)


class _Config:
    """Records what load_config does to og.Config."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[tuple[Any, ...]] = []

    def clear_providers(self) -> None:
        self.calls.append(("clear_providers",))

    def append_provider(self, name: str) -> None:
        self.calls.append(("append_provider", name))

    def set_provider_option(self, provider: str, name: str, value: str) -> None:
        self.calls.append(("set_provider_option", provider, name, value))

    def overlay(self, text: str) -> None:
        self.calls.append(("overlay", json.loads(text)))


def _model(tmp_path: Path, paged: bool) -> Path:
    # as the model builder writes it: the CUDA provider with enable_cuda_graph "0"
    engine = {"dynamic_batching": {}} if paged else {}
    genai = {
        "model": {
            "context_length": 2048,
            "decoder": {"session_options": {"provider_options": [{"cuda": {"enable_cuda_graph": "0"}}]}},
        },
        "engine": engine,
    }
    (tmp_path / "genai_config.json").write_text(json.dumps(genai))
    return tmp_path


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
@pytest.mark.parametrize("paged", [True, False])
def test_the_config_the_worker_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, paged: bool
) -> None:
    monkeypatch.setattr(genai_config.og, "Config", _Config)
    model = _model(tmp_path, paged)
    batching = {"max_batch_size": 4}
    section = "dynamic_batching" if paged else "static_batching"
    overlay = ("overlay", {"engine": {section: batching}})

    cpu = load_config(model, CPU, batching, cuda_graph=setting)
    assert isinstance(cpu, _Config)
    assert cpu.calls == [("clear_providers",), overlay]  # the CPU: no provider option at all

    cuda = load_config(model, CUDA, batching, cuda_graph=setting)
    assert isinstance(cuda, _Config)
    graph = "1" if setting == "on" or (setting == "auto" and paged) else "0"
    assert cuda.calls == [
        ("clear_providers",),
        ("append_provider", "cuda"),
        ("set_provider_option", "cuda", "device_id", "1"),
        ("set_provider_option", "cuda", "enable_cuda_graph", graph),
        overlay,
    ]


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().cuda_graph == "auto"
    monkeypatch.setenv("ORTFLEET_CUDA_GRAPH", "off")
    assert WorkerSettings().cuda_graph == "off"
    monkeypatch.setenv("ORTFLEET_CUDA_GRAPH", "sometimes")
    with pytest.raises(pydantic.ValidationError):
        WorkerSettings()


def test_the_worker_hands_the_setting_to_og_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from worker.engines import engine_choice, ort_engine

    seen: dict[str, Any] = {}

    def fake_engine(*args: Any, **kwargs: Any) -> object:
        seen.update(kwargs)
        return object()

    monkeypatch.setattr(ort_engine, "OrtEngine", fake_engine)
    engine_choice.open_engine(_model(tmp_path, True), CUDA, WorkerSettings(cuda_graph="off"))
    assert seen["cuda_graph"] == "off"
