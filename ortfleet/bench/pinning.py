"""Pinned runs: the engine's threads on cores of their own, every other fleet thread on the rest.

As on a worker host with a separate gateway and Redis: the engine never shares its cores with the
gateway, Redis, the worker's event loop or the benchmark client. The direct run's engine threads get
the same engine cores. Linux only (`os.sched_setaffinity` on thread ids).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _set(tid: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cores)
    except (ProcessLookupError, FileNotFoundError):
        pass  # the thread ended meanwhile


@dataclass(frozen=True)
class Pinning:
    engine: frozenset[int]
    rest: frozenset[int]

    @classmethod
    def split(cls, engine_cores: int | None) -> Pinning:
        """The last `engine_cores` usable cores for the engine (default: half), the others for the rest."""
        cores = sorted(os.sched_getaffinity(0))
        count = engine_cores if engine_cores is not None else max(1, len(cores) // 2)
        if not 1 <= count < len(cores):
            raise ValueError(
                f"--engine-cores {count}: this process may use {len(cores)} cores, and the engine "
                "needs at least one and the rest of the fleet at least one"
            )
        return cls(frozenset(cores[-count:]), frozenset(cores[:-count]))

    def pin_process(self, pid: int) -> None:
        """Every thread of `pid` (gateway, Redis) on the non-engine cores."""
        for tid in _threads(pid):
            _set(tid, set(self.rest))

    def pin_engine_process(self, pid: int, loop_tid: int | None = None) -> None:
        """The event-loop thread of `pid` (its main thread unless given) on the other cores; every other
        thread, the engine's, on the engine cores. Threads started later inherit their creator's."""
        loop_tid = pid if loop_tid is None else loop_tid
        for tid in _threads(pid):
            _set(tid, set(self.rest if tid == loop_tid else self.engine))

    def pin_this_process(self) -> None:
        """This process's main thread (the benchmark client) on the other cores, its other threads (the
        direct run's engine) on the engine cores."""
        main = threading.main_thread().native_id
        self.pin_engine_process(os.getpid(), main)

    def describe(self) -> dict[str, Any]:
        return {"engine_cores": sorted(self.engine), "other_cores": sorted(self.rest)}
