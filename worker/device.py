"""Choosing the device a worker runs on and configuring ORT-GenAI's providers for it."""

from __future__ import annotations

import re
from collections.abc import Callable
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
        return "" if self.index is None else str(self.index)


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
