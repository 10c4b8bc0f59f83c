"""The step crossing between an engine core and a frontend (worker/core/): a stub engine-core process
sends one encoded step of N rows a step to a frontend that reads them on its asyncio loop, and the
frontend sends a command back each step.

`python -m ortfleet.bench.crossing [--rows 256,512] [--steps 2000] [--step-ms 0,3] [--top K] [--json FILE]`
runs, for each row count and step time (0: as fast as the engine core can send), STEPS steps of rows of
one token (with the chosen logprob and K top logprobs each when --top is given) and reports per step:
the engine core's encode µs and CPU µs (encode, send and taking the frontend's commands), the latency
from the end of encode to the frontend's decode (median and p99), the frontend's decode µs and CPU µs
(`time.process_time` over the run, its event loop included), wake-ups a step and steps a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from ortfleet.bench.machine import describe
from worker.core.channel import CoreEnd, FrontendEnd, channel_pair
from worker.core.commands import Cancel, Stop
from worker.core.step_wire import LogprobBlock, Step, decode_step, encode_step


def _stub_core(
    sock: socket.socket, rows: int, steps: int, step_ms: float, top: int, report: Connection
) -> None:
    core = CoreEnd(sock)
    rng = np.random.default_rng(0)
    row_ids = np.arange(rows, dtype=np.int32)
    tokens = rng.integers(0, 50_000, rows, dtype=np.int32)
    finish = np.zeros(rows, np.int8)
    block = None
    if top:
        block = LogprobBlock(
            row_ids,
            rng.standard_normal(rows).astype(np.float64),
            rng.integers(0, 50_000, (rows, top), dtype=np.int32),
            rng.standard_normal((rows, top)).astype(np.float64),
        )
    encode_ns: list[int] = []
    commands = 0
    start_cpu = time.process_time()
    start = time.perf_counter()
    for number in range(steps):
        if step_ms:
            deadline = start + number * step_ms / 1000
            pause = deadline - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        tokens += 1
        before = time.perf_counter_ns()
        payload = encode_step(Step.one_token_each(number, rows, row_ids, tokens, finish, block))
        encode_ns.append(time.perf_counter_ns() - before)
        core.send_step(payload)
        commands += len(core.commands())
    cpu = time.process_time() - start_cpu
    while commands < steps + 1 and not core.closed:
        got = core.wait_commands(10)
        if not got:
            break
        commands += len(got)
    report.send(
        {
            "core_encode_us": round(statistics.median(encode_ns) / 1000, 2),
            "core_cpu_us_per_step": round(cpu / steps * 1e6, 2),
            "step_bytes": len(payload),
            "commands_received": commands,
        }
    )
    core.close()


async def _frontend(sock: socket.socket, steps: int) -> dict[str, Any]:
    latencies: list[int] = []
    wakeups = 0
    received = 0
    done = asyncio.Event()
    first = 0.0

    def on_steps(batch: list[Step]) -> None:
        nonlocal wakeups, received, first
        now = time.monotonic_ns()
        if not received:
            first = time.perf_counter()
        wakeups += 1
        for step in batch:
            if step.step != received:
                raise AssertionError(f"step {step.step} arrived as the {received}th")
            latencies.append(now - step.sent_ns)
            received += 1
        frontend.send(Cancel(-1))  # the commands' direction: one frame back a wake-up
        if received == steps:
            done.set()

    frontend = FrontendEnd(sock, asyncio.get_running_loop(), on_steps, done.set)
    start_cpu = time.process_time()
    await asyncio.wait_for(done.wait(), 600)
    cpu = time.process_time() - start_cpu
    elapsed = time.perf_counter() - first
    frontend.send(Stop())
    frontend.close()
    latencies.sort()
    return {
        "latency_us_median": round(latencies[len(latencies) // 2] / 1000, 1),
        "latency_us_p99": round(latencies[int(len(latencies) * 0.99)] / 1000, 1),
        "frontend_cpu_us_per_step": round(cpu / steps * 1e6, 2),
        "wakeups_per_step": round(wakeups / steps, 3),
        "steps_per_s": round((steps - 1) / elapsed) if elapsed else None,
        "received": received,
    }


def _decode_us(rows: int, top: int, repeat: int = 2000) -> float:
    """The frontend's decode of one step, timed apart from the loop."""
    zeros = np.zeros(rows, np.int32)
    block = None
    if top:
        block = LogprobBlock(
            zeros,
            zeros.astype(np.float64),
            np.zeros((rows, top), np.int32),
            np.zeros((rows, top), np.float64),
        )
    payload = encode_step(Step.one_token_each(0, rows, zeros, zeros, np.zeros(rows, np.int8), block))
    before = time.perf_counter_ns()
    for _ in range(repeat):
        decode_step(payload)
    return round((time.perf_counter_ns() - before) / repeat / 1000, 2)


def bench(rows: int, steps: int, step_ms: float, top: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    core_sock, frontend_sock = channel_pair()
    report, report_end = context.Pipe(duplex=False)
    process = context.Process(target=_stub_core, args=(core_sock, rows, steps, step_ms, top, report_end))
    process.start()
    core_sock.close()
    report_end.close()
    try:
        frontend = asyncio.run(_frontend(frontend_sock, steps))
        core = report.recv() if report.poll(30) else {}
    finally:
        process.join(30)
    return {
        "rows": rows,
        "steps": steps,
        "step_ms": step_ms,
        "top": top,
        **core,
        "frontend_decode_us": _decode_us(rows, top),
        **frontend,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.crossing", description=__doc__)
    parser.add_argument("--rows", default="256,512", help="row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", default="0,3", help="step times in ms, comma-separated (0: flat out)")
    parser.add_argument("--top", type=int, default=0, help="top logprobs a row (0: no logprob block)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    runs = [
        bench(int(rows), args.steps, float(step_ms), args.top)
        for rows in args.rows.split(",")
        for step_ms in args.step_ms.split(",")
    ]
    print(f"{args.steps} steps a run, top logprobs {args.top}; µs a step (latency: encode to frontend)")
    for run in runs:
        print(
            f"  rows {run['rows']:4} step {run['step_ms']:g} ms: core encode {run['core_encode_us']:.1f}"
            f"  core CPU {run['core_cpu_us_per_step']:.1f}  latency {run['latency_us_median']:.1f}"
            f" (p99 {run['latency_us_p99']:.1f})  frontend decode {run['frontend_decode_us']:.1f}"
            f"  frontend CPU {run['frontend_cpu_us_per_step']:.1f}  wake-ups {run['wakeups_per_step']:.2f}"
            f"  {run['steps_per_s']} steps/s  {run['step_bytes']} bytes"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "machine": describe()}, indent=2))


if __name__ == "__main__":
    main()
