"""`ortfleet bench batching`: ways for a CPU worker to step the rows of different requests together.

Candidates, on one model folder, in one run:
- session-run, session-bound, session-shared: onnxruntime's InferenceSession on the folder's graph with
  KV buffers owned by ortfleet (`session_rows`), rows of different lengths in one run per step;
- generators: one og.Generator per request (batch 1), stepped one after another;
- og-batch: one og.Generator whose batch holds every row (what og.Engine's static scheduler runs):
  the rows start together and none can join.
Correctness: every candidate's greedy tokens for each prompt against that prompt's lone og.Generator;
rows join the session and the generators two steps apart and leave when done. Timing: ms per decode
step at each batch size and past length, the candidates measured back to back.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
from tqdm import tqdm

from ortfleet.bench.machine import describe
from ortfleet.bench.report import table
from ortfleet.bench.session_rows import MODES, Layout, SessionRows, open_session
from worker.engines.genai_config import eos_token_ids, read_genai

CANDIDATES = (*(f"session-{mode}" for mode in MODES), "generators", "og-batch")
PROMPTS = (
    "The capital of France is",
    "Once upon a time there was a little robot who",
    "1, 2, 3, 4, 5, 6,",
    "Write a short poem about the sea and the wind, in the style of a sailor who has been away from "
    "home for many years and longs to see his village again:",
    "Q: What is the boiling point of water at sea level? A:",
    "List three colours:",
)
JOIN_EVERY = 2  # steps between two rows joining in the correctness run
WARM_STEPS = 2


@dataclass(frozen=True)
class BatchingOptions:
    model_dir: Path
    batch_sizes: list[int]
    past_lengths: list[int]
    steps: int  # timed decode steps per batch size, past length and candidate
    tokens: int  # greedy tokens of the first prompt in the correctness run (later ones a few fewer)


@dataclass(frozen=True)
class _Model:
    model: og.Model
    vocab_size: int
    pad_token_id: int
    eos: frozenset[int]


def run(options: BatchingOptions) -> dict[str, Any]:
    config = read_genai(options.model_dir)["model"]
    model = _Model(
        og.Model(str(options.model_dir)),
        config["vocab_size"],
        config["pad_token_id"],
        eos_token_ids(options.model_dir),
    )
    load_at_start = os.getloadavg()
    tokenizer = og.Tokenizer(model.model)
    prompts = [[int(t) for t in tokenizer.encode(text)] for text in PROMPTS]
    budgets = [max(4, options.tokens - 2 * i) for i in range(len(prompts))]
    lone = [_lone(model, prompt, budget) for prompt, budget in zip(prompts, budgets, strict=True)]
    session, layout = open_session(options.model_dir)

    batched: dict[str, list[list[int]]] = {}
    for mode in MODES:
        stepper = partial(_SessionStepper, SessionRows(session, layout, mode))
        batched[f"session-{mode}"] = _staggered(stepper, prompts, budgets, model.eos)
    generators = partial(_GeneratorStepper, model, max(budgets) + 1)
    batched["generators"] = _staggered(generators, prompts, budgets, model.eos)
    batched["og-batch"] = _og_batch_tokens(model, prompts, budgets)
    correctness = {name: _compare(tokens, lone, prompts) for name, tokens in batched.items()}

    progress = tqdm(
        total=len(options.past_lengths) * len(options.batch_sizes) * len(CANDIDATES),
        desc="batching",
        file=sys.stderr,
        leave=False,
    )
    timing = [
        entry
        for past in options.past_lengths
        for entry in _time_past(model, session, layout, options, past, progress)
    ]
    progress.close()
    _ratios(timing)
    return {
        "bench": "batching",
        "machine": describe() | {"onnxruntime": version("onnxruntime")},
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "model": str(options.model_dir),
        "options": {
            "batch_sizes": options.batch_sizes,
            "past_lengths": options.past_lengths,
            "steps": options.steps,
            "tokens": options.tokens,
        },
        "candidates": list(CANDIDATES),
        "correctness": correctness,
        "timing": timing,
    }


def _time_past(
    model: _Model,
    session: ort.InferenceSession,
    layout: Layout,
    options: BatchingOptions,
    past: int,
    progress: tqdm[Any],
) -> list[dict[str, Any]]:
    """Every candidate at each batch size, back to back, rows of `past` tokens and up to a third fewer."""
    lengths = [max(1, past - row * max(1, past // 20)) for row in range(max(options.batch_sizes))]
    rng = np.random.default_rng(0)
    rows_tokens = [rng.integers(3, model.vocab_size, length).tolist() for length in lengths]
    # the lone generators are prefilled once; each batch size steps the first ones
    reserve = (WARM_STEPS + options.steps) * len(options.batch_sizes) + 2
    lone = [_generator(model, tokens, len(tokens) + reserve) for tokens in rows_tokens]
    timing = []
    for batch in options.batch_sizes:
        figures: dict[str, dict[str, float]] = {}
        for mode in MODES:
            rows = SessionRows(session, layout, mode)
            for length in lengths[:batch]:  # the values do not change the arithmetic's cost
                zeros = np.zeros((1, layout.kv_heads, length, layout.head_size), np.float32)
                rows.join([zeros] * len(layout.past_names), length)
            figures[f"session-{mode}"] = _time(partial(rows.step, [5] * batch), batch, options.steps)
            progress.update()
        figures["generators"] = _time(partial(_step_each, lone[:batch]), batch, options.steps)
        progress.update()
        length = max(lengths[:batch]) + WARM_STEPS + options.steps + 1
        together = _generator(model, rows_tokens[:batch], length)
        figures["og-batch"] = _time(together.generate_next_token, batch, options.steps)
        progress.update()
        timing.append({"past_length": past, "batch": batch, "candidates": figures})
    return timing


def _step_each(generators: list[og.Generator]) -> None:
    for generator in generators:
        generator.generate_next_token()


def _params(model: _Model, batch: int, max_length: int) -> og.GeneratorParams:
    params = og.GeneratorParams(model.model)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=batch)
    return params


def _generator(model: _Model, tokens: list[int] | list[list[int]], max_length: int) -> og.Generator:
    """A greedy generator with `tokens` appended: one row, or right-padded rows (a batch)."""
    if tokens and isinstance(tokens[0], list):
        rows: list[list[int]] = tokens
        width = max(len(row) for row in rows)
        padded = np.full((len(rows), width), model.pad_token_id, np.int32)
        for index, row in enumerate(rows):
            padded[index, : len(row)] = row
        generator = og.Generator(model.model, _params(model, len(rows), max_length))
        generator.append_tokens(padded)
        return generator
    generator = og.Generator(model.model, _params(model, 1, max_length))
    generator.append_tokens(np.array(tokens, np.int32))
    return generator


def _lone(model: _Model, prompt: list[int], budget: int) -> list[int]:
    generator = _generator(model, prompt, len(prompt) + budget)
    tokens: list[int] = []
    while len(tokens) < budget and not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


class _SessionStepper:
    def __init__(self, rows: SessionRows) -> None:
        self.rows = rows

    def join(self, prompt: list[int]) -> int:
        logits, kv = self.rows.prefill(prompt)
        self.rows.join(kv, len(prompt))
        return int(logits.argmax())

    def step(self, last: list[int]) -> list[int]:
        return [int(t) for t in self.rows.step(last).argmax(-1)]

    def leave(self, row: int) -> None:
        self.rows.leave(row)


class _GeneratorStepper:
    def __init__(self, model: _Model, reserve: int) -> None:
        self.model, self.reserve = model, reserve
        self.generators: list[og.Generator] = []

    def join(self, prompt: list[int]) -> int:
        generator = _generator(self.model, prompt, len(prompt) + self.reserve)
        generator.generate_next_token()  # the prefill's logits: no model run
        self.generators.append(generator)
        return int(generator.get_next_tokens()[0])

    def step(self, last: list[int]) -> list[int]:
        out = []
        for generator in self.generators:
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        return out

    def leave(self, row: int) -> None:
        self.generators[row] = self.generators[-1]
        self.generators.pop()


def _staggered(
    stepper_factory: Callable[[], _SessionStepper | _GeneratorStepper],
    prompts: list[list[int]],
    budgets: list[int],
    eos: frozenset[int],
) -> list[list[int]]:
    """Greedy tokens of every prompt: prompt i joins at step i * JOIN_EVERY (prefilled alone), then all
    decode together; a row leaves when its budget or an end-of-sequence token is reached."""
    stepper = stepper_factory()
    produced: list[list[int]] = [[] for _ in prompts]
    active: list[int] = []  # the prompt of each row
    pending = list(range(len(prompts)))

    def done(index: int) -> bool:
        tokens = produced[index]
        return len(tokens) >= budgets[index] or (bool(tokens) and tokens[-1] in eos)

    step = 0
    while pending or active:
        while pending and pending[0] * JOIN_EVERY <= step:
            index = pending.pop(0)
            produced[index].append(stepper.join(prompts[index]))
            active.append(index)
        for row in reversed(range(len(active))):  # the last row takes a leaver's index
            if done(active[row]):
                stepper.leave(row)
                active[row] = active[-1]
                active.pop()
        if active:
            for row, token in enumerate(stepper.step([produced[index][-1] for index in active])):
                produced[active[row]].append(token)
        step += 1
    return produced


def _og_batch_tokens(model: _Model, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
    generator = _generator(model, prompts, max(len(p) for p in prompts) + max(budgets) + 1)
    produced: list[list[int]] = [[] for _ in prompts]
    for _ in range(max(budgets)):
        if generator.is_done():
            break
        generator.generate_next_token()
        for row, token in enumerate(generator.get_next_tokens()):
            if len(produced[row]) < budgets[row] and not (produced[row] and produced[row][-1] in model.eos):
                produced[row].append(int(token))
    return produced


def _compare(tokens: list[list[int]], lone: list[list[int]], prompts: list[list[int]]) -> dict[str, Any]:
    rows = []
    for got, want, prompt in zip(tokens, lone, prompts, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if first is None and len(got) != len(want):
            first = min(len(got), len(want))
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "generated": len(want),
                "equal": first is None,
                "first_difference": first,
            }
        )
    return {
        "rows_equal": sum(row["equal"] for row in rows),
        "rows": len(rows),
        "tokens_equal": sum(
            sum(a == b for a, b in zip(got, want, strict=False))
            for got, want in zip(tokens, lone, strict=True)
        ),
        "tokens": sum(len(want) for want in lone),
        "rows_detail": rows,
    }


def _time(step: Callable[[], object], batch: int, steps: int) -> dict[str, float]:
    for _ in range(WARM_STEPS):
        step()
    samples = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        samples.append(time.perf_counter() - started)
    mean = sum(samples) / len(samples)
    return {
        "ms_per_step": round(mean * 1000, 3),
        "ms_per_step_p50": round(float(np.median(samples)) * 1000, 3),
        "tokens_per_s": round(batch / mean, 1),
    }


def _ratios(timing: list[dict[str, Any]]) -> None:
    """Within the run: each figure's tokens/s over one lone generator's at the same past length, and its
    ms/step over og-batch's at the same batch size."""
    lone = {
        entry["past_length"]: entry["candidates"]["generators"]["tokens_per_s"]
        for entry in timing
        if entry["batch"] == 1
    }
    for entry in timing:
        og_batch = entry["candidates"]["og-batch"]["ms_per_step"]
        for figures in entry["candidates"].values():
            if entry["past_length"] in lone:
                figures["tokens_per_s_vs_lone_generator"] = round(
                    figures["tokens_per_s"] / lone[entry["past_length"]], 2
                )
            figures["ms_per_step_vs_og_batch"] = round(figures["ms_per_step"] / og_batch, 2)


def text(figures: dict[str, Any]) -> str:
    rows = [
        [
            name,
            f"{c['rows_equal']}/{c['rows']}",
            f"{c['tokens_equal']}/{c['tokens']}",
        ]
        for name, c in figures["correctness"].items()
    ]
    parts = [
        "greedy tokens against each prompt's lone og.Generator (rows joining 2 steps apart):",
        table(["candidate", "rows equal", "tokens equal"], rows),
        "",
        "decode step (ms), tokens/s, and tokens/s over one lone generator's, measured in this run:",
    ]
    headers = ["past", "batch"]
    for name in CANDIDATES:
        headers += [f"{name} ms", "tok/s", "x"]
    timing_rows = []
    for entry in figures["timing"]:
        row: list[Any] = [entry["past_length"], entry["batch"]]
        for name in CANDIDATES:
            f = entry["candidates"][name]
            row += [f["ms_per_step"], f["tokens_per_s"], f.get("tokens_per_s_vs_lone_generator")]
        timing_rows.append(row)
    parts.append(table(headers, timing_rows))
    return "\n".join(parts)
