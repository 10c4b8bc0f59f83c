"""Choosing the device a worker runs on (--device) and the host GPU index its metrics carry."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(ValueError):
    pass


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def gpu_label(self) -> str:
        """The GPU's index on the host ('' on the CPU), the label of the worker's metrics."""
        return "" if self.index is None else host_gpu_index(self.index, os.environ)


def host_gpu_index(index: int, environ: Mapping[str, str]) -> str:
    """Undo the renumbering of CUDA_VISIBLE_DEVICES and of a container's NVIDIA_VISIBLE_DEVICES: a
    container given GPU 3 sees it as cuda:0, and its metrics should still say GPU 3."""
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        visible = [v.strip() for v in environ.get(variable, "").split(",")]
        if all(v.isdigit() for v in visible) and index < len(visible):
            index = int(visible[index])
    return str(index)


def parse_device(text: str, cuda_available: Callable[[], bool]) -> Device:
    """`auto` picks CUDA (GPU 0) when the installed ORT-GenAI can use it, else the CPU."""
    match = _DEVICE.match(text.strip().lower())
    if not match or (match.group(1) != "cuda" and match.group(2) is not None):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N, not {text!r}")
    kind, index = match.group(1), match.group(2)
    if kind == "auto":
        return Device("cuda", 0) if cuda_available() else Device("cpu")
    if kind == "cuda":
        if not cuda_available():
            raise DeviceError(
                f"--device {text} asks for CUDA, but this ORT-GenAI build cannot use it: "
                "install ortfleet[cuda] (onnxruntime-genai-cuda) on a machine with an NVIDIA GPU"
            )
        return Device("cuda", int(index or 0))
    return Device("cpu")
