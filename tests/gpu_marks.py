"""The marks of the tests that need a CUDA GPU: `gpu`, and skipped where onnxruntime-genai cannot use CUDA
(`scripts/gpu-report` runs them on a GPU host)."""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return False
    return bool(og.is_cuda_available())


ON_A_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="onnxruntime-genai cannot use CUDA here"),
]
