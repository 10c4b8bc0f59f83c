from __future__ import annotations

import itertools
import re
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from ortfleet.fleet.gpu_plan import (
    NO_GPU,
    NVIDIA_SMI_QUERY,
    GpuPlanError,
    PlannedWorker,
    nvidia_smi_gpus,
    parse_gpus,
    plan_workers,
    planned_cores,
)

pytestmark = pytest.mark.unit  # no process: the first tier


def ports() -> Callable[[], int]:
    return itertools.count(9100).__next__


def gpus_found(*indexes: int) -> Callable[[], list[int]]:
    return lambda: list(indexes)


def no_gpu() -> list[int]:
    raise GpuPlanError(NO_GPU)


def plan(
    *,
    workers: int | None = None,
    gpus: str | None = None,
    device: str = "auto",
    probe: Callable[[], list[int]] = no_gpu,
    environ: Mapping[str, str] | None = None,
) -> list[PlannedWorker]:
    return plan_workers(
        workers=workers, gpus=gpus, device=device, probe=probe, pick_port=ports(), environ=environ or {}
    )


def nvidia_smi(returncode: int = 0, stdout: str = "", stderr: str = "") -> Callable[..., Any]:
    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert command == list(NVIDIA_SMI_QUERY)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    return run


def test_without_gpus_one_worker_runs_on_the_chosen_device() -> None:
    assert plan() == [PlannedWorker("worker-1", "auto", 9100)]
    assert plan(workers=3, device="cpu") == [
        PlannedWorker("worker-1", "cpu", 9100),
        PlannedWorker("worker-2", "cpu", 9101),
        PlannedWorker("worker-3", "cpu", 9102),
    ]


def test_gpus_all_pins_one_worker_to_each_gpu_nvidia_smi_lists() -> None:
    assert plan(gpus="all", probe=gpus_found(0, 1, 2)) == [
        PlannedWorker("gpu-0", "cuda:0", 9100),
        PlannedWorker("gpu-1", "cuda:1", 9101),
        PlannedWorker("gpu-2", "cuda:2", 9102),
    ]


def test_gpus_list_pins_workers_to_those_gpus_without_probing() -> None:
    assert plan(gpus="1, 3") == [
        PlannedWorker("gpu-1", "cuda:1", 9100),
        PlannedWorker("gpu-3", "cuda:3", 9101),
    ]


def test_gpus_all_counts_only_the_gpus_cuda_visible_devices_shows() -> None:
    # nvidia-smi lists the host's 4 GPUs; the workers see GPUs 2 and 3 as cuda:0 and cuda:1.
    planned = plan(gpus="all", probe=gpus_found(0, 1, 2, 3), environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [worker.device for worker in planned] == ["cuda:0", "cuda:1"]


def test_gpus_all_without_a_gpu_says_so() -> None:
    with pytest.raises(GpuPlanError, match=f"^{re.escape(NO_GPU)}$"):
        plan(gpus="all")


def test_gpus_all_with_every_gpu_hidden_says_so() -> None:
    with pytest.raises(GpuPlanError, match=r"no NVIDIA GPU found.*CUDA_VISIBLE_DEVICES"):
        plan(gpus="all", probe=gpus_found(0), environ={"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("text", ["", "gpu0", "0,,1", "-1", "0;1", "cuda:0"])
def test_bad_gpus_text_is_rejected_with_the_flag_named(text: str) -> None:
    with pytest.raises(GpuPlanError, match="--gpus must be all or a list of GPU indexes"):
        parse_gpus(text)


def test_a_gpu_named_twice_is_rejected() -> None:
    with pytest.raises(GpuPlanError, match="names a GPU twice"):
        parse_gpus("0,1,0")


def test_gpus_with_workers_is_rejected_with_the_way_to_mix_cpu_and_gpu() -> None:
    with pytest.raises(GpuPlanError, match=r"pass one of them.*--redis-url"):
        plan(gpus="0", workers=2)


def test_gpus_with_a_device_is_rejected() -> None:
    with pytest.raises(GpuPlanError, match="drop --device cpu"):
        plan(gpus="0", device="cpu")


def test_nvidia_smi_probe_reads_gpu_indexes() -> None:
    run = nvidia_smi(stdout="0\n1\n\n")
    assert nvidia_smi_gpus(run=run, which=lambda name: f"/usr/bin/{name}") == [0, 1]


def test_nvidia_smi_probe_without_nvidia_smi_finds_no_gpu() -> None:
    with pytest.raises(GpuPlanError, match=f"^{re.escape(NO_GPU)}$"):
        nvidia_smi_gpus(run=nvidia_smi(stdout="0\n"), which=lambda name: None)


def test_nvidia_smi_probe_reports_a_failing_nvidia_smi() -> None:
    run = nvidia_smi(
        returncode=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with the driver"
    )
    with pytest.raises(GpuPlanError, match=r"no NVIDIA GPU found.*exited with 9.*couldn't communicate"):
        nvidia_smi_gpus(run=run, which=lambda name: name)


def test_nvidia_smi_probe_listing_nothing_finds_no_gpu() -> None:
    with pytest.raises(GpuPlanError, match=f"^{re.escape(NO_GPU)}$"):
        nvidia_smi_gpus(run=nvidia_smi(stdout="No devices were found\n"), which=lambda name: name)


def test_several_workers_per_gpu_are_the_frontends_of_one_engine_core_per_card() -> None:
    planned = plan_workers(
        workers=None,
        gpus="0,1",
        device="auto",
        probe=no_gpu,
        pick_port=ports(),
        environ={},
        per_gpu=2,
    )
    assert [(w.name, w.device) for w in planned] == [
        ("gpu-0.1", "cuda:0"), ("gpu-0.2", "cuda:0"), ("gpu-1.1", "cuda:1"), ("gpu-1.2", "cuda:1"),
    ]  # fmt: skip
    assert [w.core for w in planned] == ["gpu-0", "gpu-0", "gpu-1", "gpu-1"]
    assert all("ORTFLEET_GPU_KV_FRACTION" not in w.env for w in planned)  # the core holds the whole cache
    assert planned_cores(planned) == {"gpu-0": ("cuda:0", 2), "gpu-1": ("cuda:1", 2)}
    with pytest.raises(GpuPlanError, match="--workers-per-gpu goes with --gpus"):
        plan_workers(
            workers=2, gpus=None, device="cpu", probe=no_gpu, pick_port=ports(), environ={}, per_gpu=2
        )
