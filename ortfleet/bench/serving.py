"""`ortfleet bench serving`: what a client of the server gets, against the engine alone, in one run.

On one model folder and one fixed list of requests (prompts from backends.PROMPTS, output lengths drawn
from --lengths by random.Random(0), the same list everywhere), every request generating exactly its
max tokens (end of sequence ignored):
- engine alone: the engine a worker on --device runs (ortfleet's batcher, or og.Engine with the model's
  dynamic batching on CUDA; opened by the worker's own code with the worker's settings from the
  environment) in this process, greedy, at each concurrency (--engine-concurrency, default the same
  levels): C closed-loop clients hand it requests directly, with no Redis, gateway or HTTP. TTFT runs
  from tokenizing the prompt to the first token; ITL is the time between tokens.
- the server at each concurrency: a local throwaway fleet (Redis, --gateways gateways, one worker on
  the model with its default scheduler) or any OpenAI-compatible server at --url (llama.cpp's
  llama-server, vLLM). C closed-loop clients (in --client-processes processes) on keep-alive
  connections, each sending the next request of the list when its last one ends, at least two requests
  per client, as streamed text completions (POST /v1/completions, stream, temperature 0,
  min_tokens = max_tokens and ignore_eos). TTFT runs from the request's send to its first text chunk;
  ITL is the time between text chunks, spread evenly over the tokens when the final usage chunk counts
  more tokens than chunks arrived (a server that sends several tokens a chunk, a token whose text waits
  for the next one). Tokens/s is every request's tokens over the level's wall time (the first request's
  send to the last token); steady tokens/s, beside it, counts only the window in which every stream was
  generating (from the last stream's first token to the first stream's last token, ortfleet.bench.steady):
  the wall time also holds the ramp-up and the drain, when a few long last requests run alone. Null, with
  the reason, where that window is empty or under a tenth of the wall time.
- models: with --models, stream i of a run names the i-th model of the list (modulo its length) as its
  `model`, for a model's LoRA adapters beside it (model_mix); each --models list runs once at each
  concurrency, in turns, --rounds times, and each run also gives its figures by name. Each list after the
  first is compared with the first at the same concurrency, round by round. The local fleet serves its
  model as `bench` and the adapters of --lora NAME=PATH (and --random-lora's random-1, ...) beside it.
- prefill interference: three requests with prompts of about --long-prompt-tokens tokens (a paragraph
  repeated, measured with the server's POST /tokenize where it has one, else ~4 characters a token)
  and 16 tokens each are sent at once; 0.5 s later a short chat request (16 tokens) is sent. The short
  one's TTFT shows whether the long prefills hold it up.

The goals are checked against the figures of this same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import aio
from ortfleet.bench import model_mix
from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.client_pool import pooled_closed_loop
from ortfleet.bench.completions import Planned, closed_loop, level_figures
from ortfleet.bench.engine_alone import engine_alone
from ortfleet.bench.http import fleet_workers, served_model
from ortfleet.bench.interference import interference
from ortfleet.bench.report import figures_header, table
from ortfleet.fleet.gpu_plan import gpu_share_env
from ortfleet.fleet.launcher import serving_fleet

LOCAL_NAME = "bench"  # the served model name of the benches' local fleets

# Goals, checked against the figures of the same run.
GOAL_SCALING_4 = 1.6  # 4 streams' tokens/s over 1 stream's, at least
GOAL_TTFT_P50 = 1.25  # 1 stream's TTFT p50 over the engine alone's, at most
GOAL_ITL_P50 = 1.1  # 1 stream's ITL p50 over the engine alone's, at most
GOAL_TOKENS_PER_S = 0.95  # 1 stream's tokens/s over the engine alone's, at least
GOAL_SHORT_TTFT_S = 3.0  # the short chat's TTFT during the interference, at most


@dataclass(frozen=True)
class ServingOptions:
    model_dir: Path | None  # the engine alone's (and the local fleet's); None: a --url without --model
    concurrency: list[int]
    requests: int  # per concurrency (the engine alone runs the same list once)
    lengths: tuple[int, int]  # output tokens of a request, drawn from MIN..MAX
    long_prompt_tokens: int
    interference: bool
    url: str | None = None  # a running OpenAI-compatible server; None starts a local fleet
    name: str | None = None  # its served model name
    command_line: str = ""
    device: str = "auto"  # the engine alone's and the local fleet's worker's
    gateways: int = 1  # of the local fleet, sharing its port
    workers: int = 1  # of the local fleet, on the device (each with its share of a GPU)
    client_processes: int = 1  # the closed-loop clients run in this many processes
    engine_concurrency: list[int] | None = None  # the engine alone's levels (default: every level)
    shared_core: bool = False  # the local fleet's workers attach to one engine core
    engine_only: bool = False  # the engine alone and nothing else: no fleet, no interference run
    models: list[tuple[str, ...]] = field(default_factory=list)  # the streams' names, mix by mix
    rounds: int = 1  # each level's runs of every mix, in turns
    lora: dict[str, Path] = field(default_factory=dict)  # the local fleet's adapters
    random_lora: int = 0  # random adapters the bench writes for the local fleet

    def mixes(self, name: str) -> list[tuple[str, ...]]:
        """The --models lists, or the served model alone."""
        return self.models or [(name,)]

    def requests_at(self, concurrency: int) -> int:
        """Requests of a level: --requests, and at least two for each client."""
        return max(self.requests, 2 * concurrency)


def plan(requests: int, lengths: tuple[int, int]) -> list[Planned]:
    """The fixed list of requests: the same for the engine alone and every concurrency (a shorter list is
    the start of a longer one)."""
    rng = random.Random(0)
    low, high = lengths
    return [Planned(i, PROMPTS[i % len(PROMPTS)], rng.randint(low, high)) for i in range(requests)]


def run(options: ServingOptions) -> dict[str, Any]:
    """The engine alone (with a model), then the server at each concurrency and the interference."""
    load_at_start = os.getloadavg()
    if options.url is None and not options.engine_only:  # before anything runs
        names = [*options.lora, *model_mix.random_names(options.random_lora)]
        model_mix.check_served(options.mixes(LOCAL_NAME), LOCAL_NAME, names)
    engine_levels = options.engine_concurrency or options.concurrency
    served_levels = [] if options.engine_only else options.concurrency
    planned = plan(max(options.requests_at(c) for c in [*engine_levels, *served_levels]), options.lengths)
    interference_run = options.interference and not options.engine_only
    runs_per_level = options.rounds * max(1, len(options.models))
    steps = (
        (1 if options.model_dir is not None else 0) + len(served_levels) * runs_per_level + interference_run
    )
    with tqdm(total=steps, desc="serving", unit="run", file=sys.stderr, leave=False) as bar:
        engine = engine_shape = None
        if options.model_dir is not None:  # before the fleet starts: nothing else runs meanwhile
            bar.set_description("engine alone")
            alone = [(c, planned[: options.requests_at(c)]) for c in engine_levels]
            engine, engine_shape = engine_alone(options.model_dir, alone, options.device)
            bar.update()
        measured: tuple[list[dict[str, Any]], dict[str, Any] | None] = ([], None)
        name: str | None = None  # the engine alone (--engine-only) serves no name
        if options.engine_only:
            pass  # no server: no levels, no interference, no name
        elif options.url is not None:
            name = options.name or (options.models[0][0] if options.models else None)
            name = name or aio.run(served_model(options.url))
            measured = _measure_server(options, options.url, name, planned, bar)
        else:
            with _local_fleet(options) as url:
                name = LOCAL_NAME
                measured = _measure_server(options, url, name, planned, bar)
    levels, interfered = measured
    figures = figures_header(
        "serving",
        options.command_line,
        load_at_start,
        options.model_dir,
        {
            "concurrency": served_levels,
            "engine_concurrency": engine_levels,
            "requests": options.requests,
            "lengths": list(options.lengths),
            "long_prompt_tokens": options.long_prompt_tokens,
            "interference": interference_run,
            "device": options.device,
            "gateways": options.gateways,
            "workers": options.workers,
            "shared_core": options.shared_core,
            "client_processes": options.client_processes,
            "models": [list(mix) for mix in options.models] or None,
            "rounds": options.rounds,
            "lora": {name: str(path) for name, path in options.lora.items()},
            "random_lora": options.random_lora,
        },
        server=None if options.engine_only else options.url or "local ortfleet fleet (started by the bench)",
        served_name=name,
    )
    figures |= {
        "requests": [{"index": p.index, "prompt": p.prompt, "max_tokens": p.max_tokens} for p in planned],
        "engine_alone": engine,
        "engine_shape": engine_shape,
        "levels": levels,
        "interference": interfered,
        "mixes": model_mix.comparisons(levels, options.mixes(name))
        if name and len(options.models) > 1
        else None,
    }
    figures["goals"] = goals(figures)
    return figures


@contextlib.contextmanager
def _local_fleet(options: ServingOptions) -> Iterator[str]:
    """The bench's throwaway fleet on the model, its workers serving the adapters of --lora and
    --random-lora; yields its URL."""
    assert options.model_dir is not None
    with tempfile.TemporaryDirectory(prefix="ortfleet-lora-") as folder:
        written = model_mix.write_random_adapters(options.model_dir, options.random_lora, Path(folder))
        flags = [f for name, path in (options.lora | written).items() for f in ("--lora", f"{name}={path}")]
        with serving_fleet(
            options.model_dir,
            LOCAL_NAME,
            options.workers,
            env={} if options.shared_core else gpu_share_env(options.device, options.workers),
            worker_args=tuple(flags),
            device=options.device,
            gateways=options.gateways,
            shared_core=options.shared_core,
        ) as url:
            yield url


def _measure_server(
    options: ServingOptions, url: str, model: str, planned: list[Planned], bar: tqdm[Any]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    warm = [Planned(-1 - i, PROMPTS[i], 8) for i in range(2)]
    counts = aio.run(fleet_workers(url, model))  # an ortfleet fleet's workers' token counts, else None
    warmed, _ = aio.run(closed_loop(url, model, warm, 2))  # allocations and caches: not measured
    if counts is not None:
        counts = aio.run(counted(url, model, counts, sum(r.tokens for r in warmed)))
    mixes = options.mixes(model)
    if options.models:  # each name's first requests: not measured either
        names = list(dict.fromkeys(name for mix in mixes for name in mix))
        warm = [Planned(-1 - i, PROMPTS[i % len(PROMPTS)], 8) for i in range(len(names))]
        aio.run(closed_loop(url, names, warm, len(names)))
    levels = []
    for concurrency in options.concurrency:
        for round_ in range(options.rounds):
            for mix in mixes:
                bar.set_description(f"c={concurrency}" + (f" {','.join(mix)}" if options.models else ""))
                results, wall = pooled_closed_loop(
                    url,
                    mix,
                    planned[: options.requests_at(concurrency)],
                    concurrency,
                    options.client_processes,
                )
                level: dict[str, Any] = {"concurrency": concurrency, "models": list(mix), "round": round_}
                level |= level_figures(results, wall)
                if len(set(mix)) > 1:
                    level["by_model"] = model_mix.by_model(results, mix, concurrency, wall)
                if counts is not None and (
                    now := aio.run(counted(url, model, counts, level["output_tokens"]))
                ):
                    level["workers"] = worker_split(counts, now)
                    counts = now
                levels.append(level)
                bar.update()
    measured = None
    if options.interference:
        bar.set_description("interference")
        measured = aio.run(interference(url, model, options.long_prompt_tokens))
        bar.update()
    return levels, measured


async def counted(
    url: str, model: str, before: dict[str, dict[str, Any]], tokens: int, timeout_s: float = 15.0
) -> dict[str, dict[str, Any]] | None:
    """The workers' counts (fleet_workers) once they hold `tokens` more than `before` (each worker's
    heartbeat refreshes its own, every few seconds); what they hold after `timeout_s` otherwise; None when
    the fleet stops answering."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = await fleet_workers(url, model)
        if after is None:
            return None
        if sum(w["tokens"] for w in worker_split(before, after)) >= tokens or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.25)


def worker_split(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each worker's part of a level: its device, its rows and the tokens it generated in the level (from
    /v1/fleet before and after it), so the split shows how the pull balanced the work."""
    return [
        {
            "worker": worker,
            "device": now["device"],
            "rows": now["rows"],
            "tokens": now["tokens"] - before.get(worker, {"tokens": 0})["tokens"],
        }
        for worker, now in sorted(after.items())
    ]


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the figure it checks and whether it passes (None: not measured in this run)."""
    first = (figures["options"].get("models") or [[figures.get("served_name")]])[0]
    by_concurrency = model_mix.first_mix_levels(figures["levels"], first)
    engine_by_concurrency = {level["concurrency"]: level for level in figures["engine_alone"] or []}
    engine, one, four = engine_by_concurrency.get(1), by_concurrency.get(1), by_concurrency.get(4)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    def goal(text: str, value: float | None, bound: float, at_least: bool) -> dict[str, Any]:
        passed = None if value is None else (value >= bound if at_least else value <= bound)
        return {"goal": text, "value": value, "bound": bound, "pass": passed}

    out = []
    if one is not None and four is not None:
        scaling = ratio(four["tokens_per_s"], one["tokens_per_s"])
        out.append(
            goal(f"4 streams' tokens/s >= {GOAL_SCALING_4}x 1 stream's", scaling, GOAL_SCALING_4, True)
        )
    if one is not None and engine is not None:
        out += [
            goal(
                f"1 stream: TTFT p50 <= {GOAL_TTFT_P50}x the engine alone's",
                ratio(one["ttft_ms"]["p50"], engine["ttft_ms"]["p50"]),
                GOAL_TTFT_P50,
                False,
            ),
            goal(
                f"1 stream: ITL p50 <= {GOAL_ITL_P50}x the engine alone's",
                ratio(one["itl_ms"]["p50"], engine["itl_ms"]["p50"]),
                GOAL_ITL_P50,
                False,
            ),
            goal(
                f"1 stream: tokens/s >= {GOAL_TOKENS_PER_S}x the engine alone's",
                ratio(one["tokens_per_s"], engine["tokens_per_s"]),
                GOAL_TOKENS_PER_S,
                True,
            ),
        ]
    for concurrency, alone in engine_by_concurrency.items():
        served = by_concurrency.get(concurrency)
        if concurrency == 1 or served is None:
            continue
        out.append(
            goal(
                f"{concurrency} streams: tokens/s >= {GOAL_TOKENS_PER_S}x the engine alone's",
                ratio(served["tokens_per_s"], alone["tokens_per_s"]),
                GOAL_TOKENS_PER_S,
                True,
            )
        )
    for mixed in figures.get("mixes") or []:
        streams, names, against = mixed["concurrency"], ",".join(mixed["models"]), ",".join(mixed["against"])
        out.append(
            goal(
                f"{streams} streams of {names}: tokens/s >= {model_mix.GOAL_MIXED}x {against}'s (median of "
                "the rounds)",
                mixed["median"],
                model_mix.GOAL_MIXED,
                True,
            )
        )
    if figures["interference"] is not None:
        short_s = figures["interference"]["short_ttft_ms"] / 1000
        out.append(
            goal(
                f"interference: the short chat's first token within {GOAL_SHORT_TTFT_S:g} s",
                round(short_s, 3),
                GOAL_SHORT_TTFT_S,
                False,
            )
        )
    return out


def text(figures: dict[str, Any]) -> str:
    headers = [
        "run", "streams", "requests", "tokens", "wall s", "tok/s", "steady tok/s", "TTFT p50", "p95",
        "ITL p50", "p95",
    ]  # fmt: skip

    def row(label: str, streams: int, f: dict[str, Any]) -> list[Any]:
        ttft, itl = f["ttft_ms"], f["itl_ms"]
        return [
            label, streams, f["requests"], f["output_tokens"], f["wall_s"], f["tokens_per_s"],
            f.get("steady_tokens_per_s"), ttft["p50"], ttft["p95"], itl["p50"], itl["p95"],
        ]  # fmt: skip

    rows = []
    rows += [row("engine alone", level["concurrency"], level) for level in figures["engine_alone"] or []]
    server = "ortfleet" if (figures.get("server") or "local").startswith("local") else "server"

    def run_label(level: dict[str, Any]) -> str:
        if not figures["options"].get("models"):
            return server
        return f"{server} {','.join(level['models'])} r{level['round'] + 1}"

    rows += [row(run_label(level), level["concurrency"], level) for level in figures["levels"]]
    low, high = figures["options"]["lengths"]
    parts = [
        f"{Path(figures['model']).name if figures['model'] else figures['served_name']}: "
        f"at least {figures['options']['requests']} requests (2 per stream) of {low}..{high} tokens per "
        "run (latencies in ms; steady tok/s: while every stream was generating)",
        table(headers, rows),
    ]
    labelled = [("engine alone", level) for level in figures["engine_alone"] or []]
    labelled += [(run_label(level), level) for level in figures["levels"]]
    for label, level in labelled:
        if level.get("steady_reason"):  # figures written before the steady window have no reason
            parts.append(
                f"{label}, {level['concurrency']} streams: no steady tok/s, {level['steady_reason']}"
            )
    if (shape := figures.get("engine_shape")) is not None:
        sizing = shape["row_sizing"]
        line = f"engine alone: {shape['engine']}, {shape['rows']} rows"
        if sizing is not None:
            steps = ", ".join(
                f"{rows}: {'-' if ms is None else ms} ms" for rows, ms in sizing["step_ms_by_rows"].items()
            )
            line += (
                f" (sized from the card: {sizing['kv_tokens']:,} KV tokens, {sizing['kv_source']}, ceiling "
                f"{sizing['ceiling']}; decode step by rows: {steps or 'not timed'})"
            )
        parts.append(line)
    for level in figures["levels"]:
        if workers := level.get("workers"):
            total = sum(w["tokens"] for w in workers) or 1
            split = ", ".join(f"{w['device']} {w['rows']} rows {w['tokens'] / total:.0%}" for w in workers)
            parts.append(f"{run_label(level)}, {level['concurrency']} streams, tokens by worker: {split}")
    parts += model_mix.lines(figures)
    if (i := figures["interference"]) is not None:
        tokens = round(sum(i["long_prompt_tokens"]) / len(i["long_prompt_tokens"]))
        runs = [["long", t, d] for t, d in zip(i["long_ttft_ms"], i["long_done_ms"], strict=True)]
        parts += [
            "",
            f"prefill interference: {i['long_requests']} prompts of ~{tokens} tokens (sized by "
            f"{i['long_prompts_sized_by']}) at once, a short chat {i['short_sent_at_ms']:.0f} ms "
            f"later, {i['max_tokens']} tokens each:",
            table(
                ["request", "TTFT ms", "done ms"],
                [*runs, ["short chat", i["short_ttft_ms"], i["short_done_ms"]]],
            ),
        ]
    parts += ["", "goals (this run's figures):"]
    for g in figures["goals"]:
        verdict = "n/a" if g["pass"] is None else ("PASS" if g["pass"] else "FAIL")
        value = "-" if g["value"] is None else f"{g['value']:g}"
        parts.append(f"  {verdict:4}  {g['goal']}: {value}")
    if not figures["goals"]:
        parts.append("  none apply (figures only)")
    return "\n".join(parts)


def parse_lengths(text: str) -> tuple[int, int]:
    """MIN:MAX output tokens, 1 <= MIN <= MAX."""
    low, sep, high = text.partition(":")
    try:
        lengths = (int(low), int(high))
    except ValueError:
        lengths = (0, 0)
    if not sep or not 1 <= lengths[0] <= lengths[1]:
        raise ValueError(f"{text!r}: give MIN:MAX tokens, 1 <= MIN <= MAX, e.g. 32:224")
    return lengths
