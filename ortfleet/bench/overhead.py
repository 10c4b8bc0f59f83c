"""`ortfleet bench` (fleet mode): the whole fleet over HTTP/SSE against its engine in-process.

Both sides get the same prompts and a fixed generation length (min_tokens = max_tokens), so
every request does the same work. The direct baseline runs the engine a CPU worker runs (the
batcher, or og.Engine for a model with paged attention) in this process; the fleet side runs
redis-server, a gateway and a worker on the same model. The two never generate at the same time:
for each concurrency the direct run goes first, then the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from common import aio
from common.keys import STANDALONE as keys  # benchmarks run on one Redis
from common.redis_client import connect
from common.wire import Timings
from ortfleet.bench.backends import PROMPTS, Backend, DirectBackend, FleetBackend, RequestResult
from ortfleet.bench.http import served_model
from ortfleet.bench.machine import cpu_seconds, describe, wakeups
from ortfleet.bench.pinning import Pinning
from ortfleet.bench.stats import summary
from ortfleet.fleet.gpu_plan import KV_FRACTION, gpu_share_env
from ortfleet.fleet.launcher import throwaway_fleet
from ortfleet.fleet.processes import StartupError

# Goals of the overhead budget (fleet against direct, same run).
GOAL_TOKENS_RATIO = 0.97
GOAL_TTFT_ADDED_P50_MS = 5.0
GOAL_TTFT_ADDED_P99_MS = 20.0
GOAL_ITL_ADDED_P50_MS = 1.0


@dataclass
class LevelRun:
    """Every request of one backend at one concurrency (all rounds)."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0  # summed over rounds
    errors: int = 0
    round_rates: list[float] = field(default_factory=list)  # tokens/s of each round

    def figures(self) -> dict[str, Any]:
        tokens = sum(r.tokens for r in self.results)
        gaps = [g for r in self.results for g in r.gaps]
        rows = [r.batch_rows for r in self.results if r.batch_rows]
        return {
            "requests": len(self.results),
            "errors": self.errors,
            "output_tokens": tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else None,
            "requests_per_s": round(len(self.results) / self.wall_s, 3) if self.wall_s else None,
            "ttft_ms": summary([r.ttft for r in self.results]),
            "itl_ms": summary(gaps),
            "engine_batch_rows_mean": round(sum(rows) / len(rows), 2) if rows else None,
            "tokens_per_s_by_round": [round(rate, 2) for rate in self.round_rates],
            **self._ttft_parts(),
        }

    def _ttft_parts(self) -> dict[str, Any]:
        """Where a fleet request's TTFT went, from its job's record: submission to the worker taking
        it; from there to the engine's first token in the worker; from there to the client, with the
        POST before the submission (the gateway and the client on one host, so one clock)."""
        timed = [
            (r.ttft, r.queue_wait, r.worker_ttft)
            for r in self.results
            if r.queue_wait is not None and r.worker_ttft is not None
        ]
        if not timed:
            return {}
        return {
            "ttft_parts_ms": {
                "submission_to_claim": summary([queued for _, queued, _ in timed]),
                "claim_to_first_token": summary([worker - queued for _, queued, worker in timed]),
                "delivery_and_post": summary([client - worker for client, _, worker in timed]),
            }
        }


async def run_level(
    backend: Backend, concurrency: int, requests: int, record: LevelRun, tick: Callable[[], None]
) -> None:
    """`concurrency` clients take requests from a shared counter until `requests` have run."""
    taken = 0

    async def client_loop() -> None:
        nonlocal taken
        generate = await backend.client()
        while taken < requests:
            prompt = PROMPTS[taken % len(PROMPTS)]
            taken += 1
            try:
                record.results.append(await generate(prompt))
            except Exception:
                record.errors += 1
                raise
            finally:
                tick()

    started = time.perf_counter()
    done_before = sum(r.tokens for r in record.results)
    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        wall = time.perf_counter() - started
        record.wall_s += wall
        record.round_rates.append((sum(r.tokens for r in record.results) - done_before) / wall)
        await backend.close_clients()


def compare(direct: dict[str, Any], fleet: dict[str, Any]) -> dict[str, Any]:
    def added(metric: str, q: str) -> float | None:
        a, b = fleet[metric][q], direct[metric][q]
        return None if a is None or b is None else round(a - b, 3)

    def ratio(metric: str) -> float | None:
        a, b = fleet[metric], direct[metric]
        return round(a / b, 4) if a and b else None

    pairs = zip(fleet["tokens_per_s_by_round"], direct["tokens_per_s_by_round"], strict=True)
    by_round = [round(a / b, 4) for a, b in pairs if b]
    return {
        "tokens_per_s": ratio("tokens_per_s"),
        "tokens_per_s_by_round": by_round,
        "tokens_per_s_median_of_rounds": round(statistics.median(by_round), 4) if by_round else None,
        "requests_per_s": ratio("requests_per_s"),
        "ttft_added_ms": {"p50": added("ttft_ms", "p50"), "p99": added("ttft_ms", "p99")},
        "itl_added_ms": {"p50": added("itl_ms", "p50"), "p99": added("itl_ms", "p99")},
    }


def goals(levels: list[dict[str, Any]]) -> dict[str, Any]:
    def all_levels(check: Callable[[dict[str, Any]], bool]) -> bool:
        return all(check(level["fleet_vs_direct"]) for level in levels)

    def within(value: float | None, bound: float) -> bool:
        return value is not None and value <= bound

    return {
        f"tokens_per_s_ratio>={GOAL_TOKENS_RATIO}": all_levels(
            lambda c: c["tokens_per_s"] is not None and c["tokens_per_s"] >= GOAL_TOKENS_RATIO
        ),
        f"ttft_added_p50<={GOAL_TTFT_ADDED_P50_MS}ms": all_levels(
            lambda c: within(c["ttft_added_ms"]["p50"], GOAL_TTFT_ADDED_P50_MS)
        ),
        f"ttft_added_p99<={GOAL_TTFT_ADDED_P99_MS}ms": all_levels(
            lambda c: within(c["ttft_added_ms"]["p99"], GOAL_TTFT_ADDED_P99_MS)
        ),
        f"itl_added_p50<={GOAL_ITL_ADDED_P50_MS}ms": all_levels(
            lambda c: within(c["itl_added_ms"]["p50"], GOAL_ITL_ADDED_P50_MS)
        ),
    }


def single_stream_tokens_per_s(levels: list[dict[str, Any]]) -> dict[str, float | None]:
    """Tokens/s of one stream: the inverse of the median inter-token latency at concurrency 1."""
    for level in levels:
        if level["concurrency"] == 1:
            out: dict[str, float | None] = {}
            for mode in ("direct", "fleet"):
                p50 = level[mode]["itl_ms"]["p50"]
                out[mode] = round(1000 / p50, 1) if p50 else None
            return out
    return {}


@dataclass(frozen=True)
class OverheadOptions:
    model_dir: Path
    concurrency: list[int]
    requests: int | None  # per concurrency and round; None: 4 x concurrency, at least 8
    max_tokens: int
    rounds: int
    url: str | None = None  # a running gateway; None starts a local fleet
    name: str | None = None  # its served model name
    pinning: Pinning | None = None  # engines on cores of their own, the rest of the fleet on the others
    stream_interval: int | None = None  # the local worker's (None with a URL: its workers' own)
    api: str = "jobs"  # the fleet's clients: FLEET_APIS
    device: str = "auto"  # the direct engine's and the local fleet's worker's

    def requests_at(self, concurrency: int) -> int:
        return self.requests or max(8, 4 * concurrency)

    def shared_card_env(self) -> dict[str, str]:
        """On a GPU, the direct engine and the local fleet's worker run side by side: each gets half of
        what workers sharing a card get (gpu_share_env), so neither starts short of memory."""
        return gpu_share_env(self.device, 2) if self.url is None else {}


def run(options: OverheadOptions) -> dict[str, Any]:
    """Starts a local fleet (unless given a URL), measures both sides, returns every figure."""
    with contextlib.ExitStack() as stack:
        url, name = options.url, options.name
        if url is None:
            fleet = stack.enter_context(throwaway_fleet())
            (_, url), name = fleet.start_gateway(), "bench"
            interval = options.stream_interval
            env = {**options.shared_card_env()}
            if interval is not None:
                env["ORTFLEET_STREAM_INTERVAL"] = str(interval)
            worker = fleet.start_worker(
                name, model=options.model_dir, device=options.device, env=env, wait=False
            )
            try:
                fleet.wait_workers(name, 1)
            except StartupError as e:
                raise StartupError(f"{e}\n{worker.log_tail()}") from e
            pids = {"gateway": fleet.gateways[0].pid, "redis": fleet.processes[0].pid, "worker": worker.pid}
            redis_url: str | None = fleet.redis_url
            if options.pinning is not None:
                options.pinning.pin_process(pids["gateway"])
                options.pinning.pin_process(pids["redis"])
                options.pinning.pin_engine_process(pids["worker"])
        else:
            pids, redis_url = {}, None
        if name is None:
            name = aio.run(served_model(url))
        return aio.run(_measure(options, url, name, CpuMeter(pids), redis_url))


async def _read_records(redis_url: str, results: list[RequestResult]) -> None:
    """The engine's batch width and the job's own timings of each fleet job, from its record (read
    after the runs)."""
    redis = connect(redis_url)
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for result in results:
                pipe.hmget(keys.job(result.job_id or ""), ["engine_batch_peak", "timings"])
            records = await pipe.execute()
    finally:
        await redis.aclose()
    for result, (peak, timings) in zip(results, records, strict=True):
        result.batch_rows = int(peak) if peak else None
        if timings:
            parsed = Timings.model_validate_json(timings)
            result.queue_wait, result.worker_ttft = parsed.queue_wait_s, parsed.ttft_s


Count = TypeVar("Count", int, float)


def _add_change(totals: dict[str, Count], before: dict[str, Count], after: dict[str, Count]) -> None:
    """Adds to each of `totals` how much its counter grew from `before` to `after`."""
    for name, value in after.items():
        totals[name] = totals.get(name, 0) + value - before[name]


class CpuMeter:
    """CPU seconds of the bench process and of the local fleet's processes, per backend and level, and
    the wake-ups of the gateway's, the worker loop's and Redis' main threads.

    The worker's event-loop thread (its main thread) is counted apart from its engine threads."""

    WOKEN = {"gateway": "gateway", "worker": "worker_loop", "redis": "redis"}  # main threads counted

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.spent: dict[tuple[str, int], dict[str, float]] = {}
        self.woken: dict[tuple[str, int], dict[str, int]] = {}

    def _wakeups_now(self) -> dict[str, int]:
        return {
            name: wakeups(self.pids[process]) for process, name in self.WOKEN.items() if process in self.pids
        }

    def _now(self) -> dict[str, float]:
        now = {"bench_process": time.process_time()}
        for name, pid in self.pids.items():
            now[name] = cpu_seconds(pid)
        if "worker" in self.pids:
            now["worker_loop"] = cpu_seconds(self.pids["worker"], self.pids["worker"])
            now["worker"] -= now["worker_loop"]
        return now

    @contextlib.contextmanager
    def measure(self, backend: str, concurrency: int) -> Iterator[None]:
        before, woken_before = self._now(), self._wakeups_now()
        yield
        after, woken_after = self._now(), self._wakeups_now()
        _add_change(self.spent.setdefault((backend, concurrency), {}), before, after)
        _add_change(self.woken.setdefault((backend, concurrency), {}), woken_before, woken_after)

    def per_token(self, backend: str, concurrency: int, tokens: int) -> dict[str, float]:
        """Milliseconds of CPU per generated token, by process."""
        spent = self.spent.get((backend, concurrency), {})
        if backend == "direct":
            spent = {"bench_process": spent.get("bench_process", 0.0)}
        else:
            names = {"worker": "worker_engine", "bench_process": "client"}
            spent = {names.get(k, k): v for k, v in spent.items()}
            overhead = [spent[k] for k in ("gateway", "worker_loop", "redis") if k in spent]
            if overhead:
                spent["fleet_overhead"] = sum(overhead)  # gateway + worker event loop + Redis
        return {name: round(seconds * 1000 / tokens, 4) for name, seconds in spent.items()} if tokens else {}

    def wakeups_per_token(self, concurrency: int, tokens: int) -> dict[str, float]:
        """Wake-ups per generated token of the fleet's main threads (the local fleet's run only)."""
        woken = self.woken.get(("fleet", concurrency), {})
        return {name: round(count / tokens, 3) for name, count in woken.items()} if tokens else {}


async def _measure(
    options: OverheadOptions, url: str, name: str, cpu: CpuMeter, redis_url: str | None
) -> dict[str, Any]:
    share = options.shared_card_env().get(KV_FRACTION)
    direct = DirectBackend(
        options.model_dir, options.max_tokens, options.device, float(share) if share else None
    )
    fleet = FleetBackend(url, name, options.max_tokens, options.api)
    if options.pinning is not None:
        options.pinning.pin_this_process()
    backends: list[Backend] = [direct, fleet]
    runs = {(b.name, c): LevelRun() for b in backends for c in options.concurrency}
    total = 2 * options.rounds * sum(options.requests_at(c) for c in options.concurrency)
    try:
        with tqdm(total=total, desc="warm-up", unit="req", file=sys.stderr, leave=False) as bar:
            for backend in backends:  # first requests pay for allocations and caches: not measured
                await run_level(backend, 4, 4, LevelRun(), lambda: None)
            for round_ in range(options.rounds):
                for concurrency in options.concurrency:
                    for backend in backends:
                        bar.set_description(f"round {round_ + 1} c={concurrency} {backend.name}")
                        run = runs[(backend.name, concurrency)]
                        if options.pinning is not None:  # engine threads started since go where they belong
                            options.pinning.pin_this_process()
                        with cpu.measure(backend.name, concurrency):
                            await run_level(
                                backend, concurrency, options.requests_at(concurrency), run, bar.update
                            )
    finally:
        direct.close()
    if redis_url is not None:
        fleet_results = [r for c in options.concurrency for r in runs[("fleet", c)].results]
        await _read_records(redis_url, fleet_results)
    levels = []
    for concurrency in options.concurrency:
        figures = {b.name: runs[(b.name, concurrency)].figures() for b in backends}
        for side, values in figures.items():
            values["cpu_ms_per_token"] = cpu.per_token(side, concurrency, values["output_tokens"])
        if wakeups := cpu.wakeups_per_token(concurrency, figures["fleet"]["output_tokens"]):
            figures["fleet"]["wakeups_per_token"] = wakeups
        levels.append(
            {
                "concurrency": concurrency,
                **figures,
                "fleet_vs_direct": compare(figures["direct"], figures["fleet"]),
            }
        )
    return {
        "bench": "fleet",
        "machine": describe(),
        "load_average": os.getloadavg(),
        "model": str(options.model_dir),
        "served_name": name,
        "gateway": url if options.url else "local (started by the bench)",
        "max_tokens": options.max_tokens,
        "min_tokens": options.max_tokens,
        "rounds": options.rounds,
        "pinning": options.pinning.describe() if options.pinning is not None else None,
        "stream_interval": options.stream_interval,
        "api": options.api,
        "prompts": list(PROMPTS),
        "levels": levels,
        "single_stream_tokens_per_s": single_stream_tokens_per_s(levels),
        "goals": goals(levels),
    }
