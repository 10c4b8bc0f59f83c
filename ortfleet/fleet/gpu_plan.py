"""Which workers `ortfleet up` starts: N on one device (`--workers`), or one pinned to each GPU
(`--gpus all|0,1`), each with a /metrics port of its own."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

NO_GPU = "no NVIDIA GPU found: --gpus needs nvidia-smi and a GPU"
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=index", "--format=csv,noheader")
_NVIDIA_SMI_TIMEOUT_S = 30.0

GpuProbe = Callable[[], list[int]]
PortPicker = Callable[[], int]


class GpuPlanError(ValueError):
    pass


# The share of a GPU's memory the paged KV caches of the workers on it take together, when several share
# it (each gets its part: ORTFLEET_GPU_KV_FRACTION); the rest holds their weights and activations.
SHARED_GPU_KV = 0.8
KV_FRACTION = "ORTFLEET_GPU_KV_FRACTION"  # the setting that gives a worker its share


@dataclass(frozen=True)
class PlannedWorker:
    name: str
    device: str
    metrics_port: int
    env: Mapping[str, str] = field(default_factory=dict)  # the worker's own settings
    core: str = ""  # the shared engine core it attaches to ('': an engine core of its own)


def parse_gpus(text: str) -> list[int] | None:
    """``all`` -> None (every GPU, found when planning); ``0,1`` -> [0, 1]."""
    cleaned = text.strip().lower()
    if cleaned == "all":
        return None
    parts = [part.strip() for part in cleaned.split(",")]
    if not parts or not all(part.isdigit() for part in parts):
        raise GpuPlanError(f"--gpus must be all or a list of GPU indexes such as 0,1, not {text!r}")
    indexes = [int(part) for part in parts]
    if len(set(indexes)) != len(indexes):
        raise GpuPlanError(f"--gpus names a GPU twice: {text!r}")
    return indexes


def nvidia_smi_gpus(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
) -> list[int]:
    """The host's GPU indexes as nvidia-smi lists them; :class:`GpuPlanError` when it finds none."""
    if which(NVIDIA_SMI_QUERY[0]) is None:
        raise GpuPlanError(NO_GPU)
    try:
        result = run(
            list(NVIDIA_SMI_QUERY), capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuPlanError(f"{NO_GPU} (nvidia-smi: {e})") from e
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise GpuPlanError(f"{NO_GPU} (nvidia-smi exited with {result.returncode}: {' '.join(detail)[:200]})")
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    if not lines or not all(line.isdigit() for line in lines):
        raise GpuPlanError(NO_GPU)
    return [int(line) for line in lines]


def visible_gpus(probe: GpuProbe, environ: Mapping[str, str]) -> list[int]:
    """The CUDA ordinals a worker can open (``cuda:N``). nvidia-smi numbers the host's GPUs, while a
    process with CUDA_VISIBLE_DEVICES set sees only those, renumbered from 0."""
    host = probe()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(len(host)))
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    # CUDA stops at the first entry that names no GPU; count what is left, at most what is installed.
    count = min(len(entries), len(host))
    if count == 0:
        raise GpuPlanError(f"{NO_GPU} (CUDA_VISIBLE_DEVICES={visible!r} hides every GPU)")
    return list(range(count))


def plan_workers(
    *,
    workers: int | None,
    gpus: str | None,
    device: str,
    probe: GpuProbe,
    pick_port: PortPicker,
    environ: Mapping[str, str],
    per_gpu: int = 1,
) -> list[PlannedWorker]:
    """The workers to start. Without ``gpus``: ``workers`` (default 1) on ``device``, named worker-N.
    With ``gpus``: ``per_gpu`` workers (default 1) on each GPU's ``cuda:N``, named gpu-N; several on one
    GPU (gpu-N.K) are the frontends of one shared engine core, gpu-N, which holds the card's model and
    KV cache and gives each its share of the rows; ``all`` asks ``probe`` for them.

    ``--gpus`` rejects ``--workers`` and a ``--device`` other than auto: one `up` serves one model
    folder, and the GPU fleet's default model (fp16, paged attention) runs only on CUDA. Start a CPU
    fleet with a second `ortfleet up --redis-url ...` against the same Redis instead."""
    if gpus is None:
        if per_gpu != 1:
            raise GpuPlanError("--workers-per-gpu goes with --gpus")
        count = 1 if workers is None else workers
        return [PlannedWorker(f"worker-{i}", device, pick_port()) for i in range(1, count + 1)]
    if workers is not None:
        raise GpuPlanError(
            "--gpus starts one worker per GPU and --workers N workers on --device: pass one of them; "
            "for CPU workers beside the GPU ones, run another `ortfleet up --redis-url URL --workers N`"
        )
    if device.strip().lower() != "auto":
        raise GpuPlanError(f"--gpus picks each worker's device (cuda:N): drop --device {device}")
    indexes = parse_gpus(gpus)
    if indexes is None:
        indexes = visible_gpus(probe, environ)
    if per_gpu == 1:
        return [PlannedWorker(f"gpu-{index}", f"cuda:{index}", pick_port()) for index in indexes]
    return [
        PlannedWorker(f"gpu-{index}.{k}", f"cuda:{index}", pick_port(), core=f"gpu-{index}")
        for index in indexes
        for k in range(1, per_gpu + 1)
    ]


def planned_cores(plan: list[PlannedWorker]) -> dict[str, tuple[str, int]]:
    """The shared engine cores a plan needs: name -> (device, workers attached)."""
    cores: dict[str, tuple[str, int]] = {}
    for worker in plan:
        if worker.core:
            device, count = cores.get(worker.core, (worker.device, 0))
            cores[worker.core] = (device, count + 1)
    return cores


def gpu_share_env(device: str, workers: int) -> dict[str, str]:
    """The settings of each of `workers` workers sharing one GPU: its share of the card's memory for its
    KV cache (nothing for one worker, or off a GPU)."""
    if workers == 1 or not device.startswith("cuda"):
        return {}
    return {KV_FRACTION: f"{SHARED_GPU_KV / workers:.4f}"}
