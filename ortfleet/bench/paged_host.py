"""The paged engine's host work per step (worker/engines/paged/engine.py), on a fake paged device that takes
a card's time: how much of the engine thread's CPU a step of N decoding rows costs, and where it goes.

`python -m ortfleet.bench.paged_host [--rows 256,512] [--step-ms 4] [--grammar-rows 0,16] [--seconds 5]
[--model DIR] [--json FILE]` runs, for each row count and each count of grammar rows, the real PagedEngine
(its scheduler, block tables, the packing of the run's inputs and of the sampler graph's, each row's
bookkeeping and the updates handed to the event loop) on:

- a fake PagedRunner: each run packs its inputs as the card's runner does (model.py's `pack`), then sleeps
  `--step-ms` (the card's run), and gives logits that are already there, as the card's runner does
  (`run`: an OrtValue over a buffer of zeros, not copied, and the rows taken), so that the engine takes
  its device path: the graph reads them there, and only the rows the host needs are gathered for it;
- a fake sampler graph (ORTFLEET_SAMPLING=graph): the real packing of each row's parameters
  (`SamplerGraph.pack`), then token ids for the rows it serves, as the card's graph returns them, without
  reading the logits. Rows under a grammar (`--grammar-rows`, a regular expression that never ends) are
  flagged for the host, gathered to it (on the CPU provider here) and picked by RowSampler over their
  logits, as on a card.

With `--driven [--steps 500]` the engine has no thread and no event loop: the bench calls its step on its
own thread, back to back (the device's run takes no time), and the figure is that thread's CPU a step, the
engine's own host work with nothing beside it. Without it, the event loop takes each step's updates while
the engine's thread goes on, as in a worker; on a machine whose cores are few or shared (hyper-threads),
the two slow each other, and the engine thread's CPU a step shows it.

Every row is a request that never ends in the measured time (end of sequence masked, max_tokens past it).
The figures: steps a second, tokens a second delivered to the event loop, and the engine thread's CPU a
step (`time.thread_time` on that thread: the fake device's sleep costs none), split into the engine's
parts (scheduler, packing, sampler packing, charges and counters, the per-row path, handing the updates
on). The split's timers cost about a microsecond a part and step, inside the total.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ortfleet.bench.argument_types import positive
from ortfleet.bench.machine import describe
from ortfleet.bench.report import write_json
from worker.engine import EngineUpdate, GenerationRequest
from worker.engines.device_sampling.runner import SampledStep, SamplerGraph
from worker.engines.engine_loading import freeze_loaded_objects
from worker.engines.paged.engine import PagedEngine
from worker.engines.paged.model import MAX_ROWS, PackedRow, pack

GRAMMAR = ("regex", "[a-z ]*")  # a document that never ends


class FakeDevice:
    """A PagedRunner whose run takes `step_s` of wall time and no CPU, after packing its inputs as model.py
    does (in runs of at most MAX_ROWS rows: a card's operator takes no more). Each call stamps the engine
    thread's CPU time, so the CPU between two runs is a step's host work."""

    def __init__(self, vocab: int, blocks: int, block_size: int, step_s: float, most_taken: int) -> None:
        self.vocab = vocab
        self.blocks = blocks
        self.block_size = block_size
        self.step_s = step_s
        self._logits = np.zeros((most_taken, vocab), np.float32)  # zero pages: only read rows cost
        self.stamps: list[float] = []  # the engine thread's CPU time at each run's start
        self.walls: list[float] = []
        self.rows: list[int] = []
        self.phases: dict[str, float] = defaultdict(float)
        self.split: list[dict[str, float]] = []  # the parts' times at each run's start
        self.last_run = 0  # once this many runs have started, `enough` is set (0: never)
        self.enough = threading.Event()

    def run(self, rows: Sequence[PackedRow]) -> tuple[ort.OrtValue, np.ndarray]:
        """The paged engine's device path (model.py's `run`): the logits where they lie, the rows taken."""
        returned = self.returned_logits(rows)
        return ort.OrtValue.ortvalue_from_numpy(returned), np.arange(len(returned), dtype=np.int64)

    def returned_logits(self, rows: Sequence[PackedRow]) -> np.ndarray:
        self.stamps.append(time.thread_time())
        self.walls.append(time.perf_counter())
        self.rows.append(len(rows))
        self.split.append(dict(self.phases))
        if self.last_run and len(self.stamps) >= self.last_run:
            self.enough.set()
        taken = 0
        for start in range(0, len(rows), MAX_ROWS):
            taken += len(pack(rows[start : start + MAX_ROWS], self.block_size)["taken"])
        self.phases["pack the run's inputs"] += time.thread_time() - self.stamps[-1]
        time.sleep(self.step_s)
        return self._logits[:taken]


class FakeSamplerGraph(SamplerGraph):
    """The sampler graph's host side (packing each row's parameters), and the card's answer: token ids for
    the rows it serves, without reading the logits."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int) -> None:
        super().__init__(eos_token_ids, vocab_size)  # its session is made, and never run
        allowed = np.flatnonzero(~self._eos)
        self._tokens = allowed[np.arange(4 * MAX_ROWS) % allowed.size].astype(np.int64)

    def run_packed(self, feeds: dict[str, np.ndarray], logits: Any, taken: Any = None) -> SampledStep:
        rows = feeds["host_in"].size
        return SampledStep(
            self._tokens[:rows],
            np.zeros(rows, np.float32),
            np.zeros((rows, 20), np.int64),
            np.zeros((rows, 20), np.float32),
            feeds["host_in"],
        )


def _timed(phases: dict[str, float], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            phases[name] += time.thread_time() - began

    return timed


# The engine's parts the split times (where an engine has them), as (path from the engine, name).
PARTS = (
    ("_paged_rows.scheduler.plan", "schedule (plan)"),
    ("_paged_rows.scheduler.advance", "schedule (advance)"),
    ("_picks", "sampler graph's packing and picks"),
    ("_charge", "work shares' charges"),
    ("_count", "counters"),
    ("_step", "step"),
)


def _instrument(engine: PagedEngine, phases: dict[str, float]) -> None:
    for path, name in PARTS:
        *owners, attribute = path.split(".")
        owner: Any = engine
        try:
            for part in owners:
                owner = getattr(owner, part)
            method = getattr(owner, attribute)
        except AttributeError:
            continue
        setattr(owner, attribute, _timed(phases, name, method))


async def measure(
    model_dir: Path,
    rows: int,
    step_ms: float,
    seconds: float,
    grammar_rows: int = 0,
    prompt_tokens: int = 512,
    block_size: int = 256,
    warmup_s: float = 1.0,
) -> dict[str, Any]:
    """One run of `rows` decoding rows (`grammar_rows` of them under a grammar); its figures."""
    context, vocab = _shape(model_dir)
    prompt_tokens = min(prompt_tokens, context // 4)
    blocks = rows * -(-context // block_size)
    chunk = min(block_size, 256)
    device = FakeDevice(vocab, blocks, block_size, step_ms / 1000, rows + chunk)
    engine = PagedEngine(model_dir, lambda: device, rows, chunk, sampler=FakeSamplerGraph)
    freeze_loaded_objects()  # as a worker and an engine core do once their engine is loaded
    _instrument(engine, device.phases)
    counted = {"tokens": 0}

    def take(update: EngineUpdate) -> None:
        counted["tokens"] += len(update.token_ids)
        if update.finish is not None:
            raise RuntimeError(f"a row ended ({update.finish}, {update.error}): the bench's rows never end")

    left = context - prompt_tokens - 1
    try:
        for stream in engine.submit(_requests(rows, grammar_rows, prompt_tokens, left, vocab)):
            stream.updates.consume(take)
        deadline = time.monotonic() + 60
        while engine.rows() != (0, 0, rows):  # every prompt in: decoding rows only
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rows did not all reach decoding: {engine.rows()}")
            await asyncio.sleep(0.05)
        # The rows end after `left` decode runs: the window closes well before, however fast the steps.
        device.last_run = len(device.stamps) + left - max(10, left // 5)
        await asyncio.sleep(warmup_s)
        first, tokens_before = len(device.stamps), counted["tokens"]
        if first >= device.last_run:
            raise RuntimeError(f"the warm-up took the {left} runs the rows have: warm up less")
        await asyncio.to_thread(device.enough.wait, seconds)
        last, tokens = min(len(device.stamps), device.last_run) - 1, counted["tokens"] - tokens_before
        steps = last - first
        cpu = device.stamps[last] - device.stamps[first]
        wall = device.walls[last] - device.walls[first]
        decoding = device.rows[first:last]
        before, after = device.split[first], device.split[last]
        split = {name: after[name] - before.get(name, 0.0) for name in after}
    finally:
        engine.close()
    step_ms_host = cpu / steps * 1000
    within = split.pop("step", 0.0)
    parts = {name: round(value / steps * 1000, 3) for name, value in sorted(split.items())}
    parts["each row's path (_next) and the rest of the step"] = round(
        (within - sum(split.values())) / steps * 1000, 3
    )
    parts["between steps (handing updates on, commands)"] = round((cpu - within) / steps * 1000, 3)
    return {
        "rows": rows,
        "grammar_rows": grammar_rows,
        "step_ms": step_ms,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "vocab": vocab,
        "steps": steps,
        "rows_per_step": round(sum(decoding) / max(len(decoding), 1), 1),
        "steps_per_s": round(steps / wall, 1),
        "tokens_per_s": round(tokens / wall),
        "host_cpu_ms_per_step": round(step_ms_host, 3),
        "host_cpu_us_per_row": round(step_ms_host * 1000 / rows, 2),
        "parts_ms_per_step": parts,
    }


class _DrivenEngine(PagedEngine):
    """The paged engine without a thread of its own: the bench calls its step (`measure_driven`)."""

    def _main(self) -> None:
        return


async def measure_driven(
    model_dir: Path,
    rows: int,
    steps: int,
    grammar_rows: int = 0,
    prompt_tokens: int = 512,
    block_size: int = 256,
) -> dict[str, Any]:
    """`rows` decoding rows stepped `steps` times back to back on this thread (the device's run takes no
    time, and no event loop takes the updates): the engine's own host work a step, with nothing beside it."""
    context, vocab = _shape(model_dir)
    prompt_tokens = min(prompt_tokens, context // 4)
    left = context - prompt_tokens - 1
    if steps >= left:
        raise ValueError(f"{steps} steps: the rows end after {left} tokens; ask for fewer")
    device = FakeDevice(vocab, rows * -(-context // block_size), block_size, 0.0, rows + min(block_size, 256))
    engine = _DrivenEngine(model_dir, lambda: device, rows, min(block_size, 256), sampler=FakeSamplerGraph)
    try:
        engine.submit(_requests(rows, grammar_rows, prompt_tokens, left, vocab))
        deadline = time.monotonic() + 60
        while engine.rows() != (0, 0, rows):  # every prompt in (a grammar's start comes from the loop)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rows did not all reach decoding: {engine.rows()}")
            engine._drain_commands(block=False)
            engine._step([])
            await asyncio.sleep(0 if any(engine.rows()) else 0.01)
        freeze_loaded_objects()
        began = time.thread_time()
        for _ in range(steps):
            engine._step([])
        cpu = time.thread_time() - began
    finally:
        engine.close()
    return {
        "mode": "driven",
        "rows": rows,
        "grammar_rows": grammar_rows,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "vocab": vocab,
        "steps": steps,
        "host_cpu_ms_per_step": round(cpu / steps * 1000, 3),
        "host_cpu_us_per_row": round(cpu / steps / rows * 1e6, 2),
    }


def _shape(model_dir: Path) -> tuple[int, int]:
    from worker.engines.genai_config import context_length, vocab_size

    vocab = vocab_size(model_dir)
    if vocab is None:
        raise ValueError(f"{model_dir}'s genai_config.json gives no vocab_size")
    return context_length(model_dir), vocab


def _requests(
    rows: int, grammar_rows: int, prompt_tokens: int, left: int, vocab: int
) -> list[GenerationRequest]:
    """Rows that never end in the measured time (end of sequence masked, max_tokens past it); the first
    `grammar_rows` under a grammar."""
    rng = np.random.default_rng(0)
    return [
        GenerationRequest(
            [int(t) for t in rng.integers(10, vocab, prompt_tokens)],
            max_new_tokens=left,
            min_new_tokens=left,
            guidance=GRAMMAR if index < grammar_rows else None,
        )
        for index in range(rows)
    ]


def text(runs: list[dict[str, Any]]) -> str:
    lines = ["the paged engine on a fake paged device: its thread's CPU a step (the device's sleep excluded)"]
    for run in runs:
        if run.get("mode") == "driven":
            lines.append(
                f"  rows {run['rows']:4} ({run['grammar_rows']} under a grammar), driven, "
                f"{run['steps']} steps: host {run['host_cpu_ms_per_step']} ms a step "
                f"({run['host_cpu_us_per_row']} µs a row)"
            )
            continue
        lines.append(
            f"  rows {run['rows']:4} ({run['grammar_rows']} under a grammar), device {run['step_ms']} ms: "
            f"host {run['host_cpu_ms_per_step']} ms a step ({run['host_cpu_us_per_row']} µs a row), "
            f"{run['steps_per_s']} steps/s, {run['tokens_per_s']:,} tokens/s"
        )
        for name, ms in run["parts_ms_per_step"].items():
            lines.append(f"      {ms:7.3f} ms  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.paged_host", description=__doc__)
    parser.add_argument("--rows", default="256,512", help="decoding rows, comma-separated (default 256,512)")
    parser.add_argument("--grammar-rows", default="0,16", help="of them under a grammar (default 0,16)")
    parser.add_argument("--step-ms", type=float, default=4.0, help="the fake device's run (default 4 ms)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured a run (default 5)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="each row's prompt (default 512)")
    parser.add_argument("--block-size", type=int, default=256, help="KV block size (default 256, a card's)")
    parser.add_argument(
        "--model", type=Path, help="model folder (tokenizer, vocabulary; default: the default model)"
    )
    parser.add_argument(
        "--driven",
        action="store_true",
        help="step the engine on the bench's own thread, back to back, no event loop beside it (the engine's "
        "host work alone)",
    )
    parser.add_argument(
        "--steps", type=positive, default=500, help="steps measured with --driven (default 500)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from common.model_folder import default_model_dir
        from common.settings import FleetSettings

        model_dir = default_model_dir(FleetSettings().model_cache)
    runs = [
        asyncio.run(
            measure_driven(
                model_dir, int(rows), args.steps, int(grammar), args.prompt_tokens, args.block_size
            )
            if args.driven
            else measure(
                model_dir,
                int(rows),
                args.step_ms,
                args.seconds,
                int(grammar),
                args.prompt_tokens,
                args.block_size,
            )
        )
        for rows in args.rows.split(",")
        for grammar in args.grammar_rows.split(",")
    ]
    print(text(runs))
    if args.json:
        shown = sys.argv[1:] if argv is None else argv
        figures = {"command_line": " ".join(["python -m ortfleet.bench.paged_host", *shown]), "runs": runs}
        write_json(args.json, {**figures, "machine": describe()})


if __name__ == "__main__":
    main()
