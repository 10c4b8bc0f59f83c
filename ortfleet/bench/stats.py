"""Percentiles and summaries of latency samples."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float], scale: float = 1000.0, digits: int = 3) -> dict[str, float | None]:
    """p50/p95/p99/max/mean of seconds, in milliseconds by default."""

    def shown(value: float | None) -> float | None:
        return None if value is None else round(value * scale, digits)

    return {
        "p50": shown(percentile(values, 50)),
        "p95": shown(percentile(values, 95)),
        "p99": shown(percentile(values, 99)),
        "max": shown(max(values) if values else None),
        "mean": shown(sum(values) / len(values) if values else None),
        "n": len(values),
    }
