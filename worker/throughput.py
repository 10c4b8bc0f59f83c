from __future__ import annotations

from collections import deque


class Throughput:
    """Tokens per second over a sliding window, from samples of a running total."""

    def __init__(self, started_at: float, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque([(started_at, 0)])

    def update(self, total: int, now: float) -> float:
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        first_at, first_total = self._samples[0]
        elapsed = now - first_at
        return (total - first_total) / elapsed if elapsed > 0 else 0.0
