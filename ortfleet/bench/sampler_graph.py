"""The sampler graph (worker/engines/device_sampling/) against `RowSampler`'s per-row loop, on one step of
seeded random logits.

`python -m ortfleet.bench.sampler_graph [--rows N] [--vocab V] [--tokens T] [--repeat R] [--device cpu|cuda]
[--profile DIR] [--json FILE]` times, for each kind of row (greedy, temperature over the whole vocabulary,
top_k 50, top_p 0.9, and top_p 0.9 with 20 log-probabilities), one step of N such rows: the graph's run
(packing included) and RowSampler's `choose` over every row (with `token_logprobs` where they are asked),
each the median of R runs.

The graph reads the logits as the paged engine hands them over (`SamplerGraph.run` with `taken`): the
run's logits [tokens, vocab] as an OrtValue where the model leaves them, in the model's type, and the rows
taken: all of them, in order, by default (a step of decodes: read as they are), or N of `--tokens T`
(gathered at the graph's head, as for prompt chunks and runs padded for CUDA graphs). With `--device cuda`
the graph runs on the CUDA execution provider over float16 logits on cuda:0 (not copied; only its outputs
come to the host); with `--device cpu`, on the CPU provider over float32 logits (the CPU paged model's).
RowSampler picks from the same values as float32.
Also timed: bringing 16 rows of those logits to the host (`host_rows`, what a step's grammar rows cost).

With `--profile DIR`, onnxruntime's profile of the graph's session: each kind of node's time on each
provider over every run, and each provider's total, in the figures (`nodes`, `providers`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ortfleet.bench.machine import describe
from worker.engine import GenerationRequest
from worker.engines.batcher.sampler import RowSampler, token_logprobs
from worker.engines.device_sampling.runner import SamplerGraph

_EOS = frozenset({0})
KINDS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature": {"temperature": 0.8},
    "top_k 50": {"temperature": 0.8, "top_k": 50},
    "top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_p 0.9, logprobs 20": {"temperature": 0.8, "top_p": 0.9, "logprobs": 20},
}


def _median_ms(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


PROVIDERS = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
}


def bench(
    rows: int,
    vocab: int,
    repeat: int,
    seed: int = 0,
    device: str = "cpu",
    profile: Path | None = None,
    tokens: int | None = None,
) -> dict[str, Any]:
    """`tokens`: the run's logits rows (default `rows`: a step of decodes, read as they are); more, and the
    rows are taken from among them (gathered at the graph's head, as for prompt chunks and padded runs)."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    tokens = max(tokens or rows, rows)
    element = np.float16 if device == "cuda" else np.float32  # as the paged model leaves them there
    run = (rng.standard_normal((tokens, vocab)) * 8).astype(element)  # peaked enough for a nucleus
    taken = np.sort(rng.permutation(tokens)[:rows]) if tokens > rows else np.arange(rows, dtype=np.int64)
    logits = run[taken].astype(np.float32)
    options = ort.SessionOptions()
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile / "sampler-graph")
    graph = SamplerGraph(_EOS, vocab, providers=PROVIDERS[device], options=options)
    given = ort.OrtValue.ortvalue_from_numpy(run, device, 0)
    produced = [0] * rows
    kinds: dict[str, Any] = {}
    for name, options in KINDS.items():
        requests = [GenerationRequest([1, 2, 3], 16, seed=row, **options) for row in range(rows)]
        samplers = [RowSampler(r, _EOS, vocab, None) for r in requests]
        top = options.get("logprobs")
        hosted = int(graph.run(given, samplers, produced, taken).host.sum())  # also the first run's warm-up

        def cpu_loop(samplers: list[RowSampler] = samplers, top: int | None = top) -> None:
            for index, sampler in enumerate(samplers):
                token = sampler.choose(logits[index].copy(), 0)
                if top is not None:
                    token_logprobs(logits[index], token, top)

        def graph_step(samplers: list[RowSampler] = samplers) -> None:
            graph.run(given, samplers, produced, taken)
            for sampler in samplers:
                sampler.accept(0)  # the step's draws are spent, as after a pick

        kinds[name] = {
            "graph_ms": _median_ms(graph_step, repeat),
            "row_sampler_ms": _median_ms(cpu_loop, repeat),
            "host_rows": hosted,
        }
    sixteen = np.arange(min(16, rows), dtype=np.int64)
    host_rows_ms = _median_ms(lambda: graph.host_rows(given, sixteen), repeat)
    provider = PROVIDERS[device][0]
    result: dict[str, Any] = {
        "rows": rows,
        "vocab": vocab,
        "repeat": repeat,
        "provider": provider,
        "tokens": tokens,
        "logits": f"{np.dtype(element).name} [tokens, vocab] on {device}, the rows taken from them",
        "kinds": kinds,
        "host_rows_16_ms": host_rows_ms,
    }
    if profile is not None:
        result["nodes"] = node_times(Path(graph.end_profiling()))
        result["providers"] = provider_times(result["nodes"])
    return result


def node_times(trace: Path, top: int | None = None) -> list[dict[str, Any]]:
    """onnxruntime's profile of the session: the time of each kind of node on each provider over every
    run, the costliest first, in ms (with the number of nodes of that kind); every kind, or the `top`."""
    spent: dict[tuple[str, str], list[float]] = {}
    for event in json.loads(trace.read_text()):
        details = event.get("args") or {}
        kernel = event.get("cat") == "Node" and event["name"].endswith("_kernel_time")
        if not kernel or "op_name" not in details:
            continue
        key = (details["op_name"], details.get("provider", "?"))
        spent.setdefault(key, []).append(event.get("dur", 0) / 1000)
    ranked = sorted(spent.items(), key=lambda item: -sum(item[1]))[:top]
    return [
        {"op": op, "provider": provider, "ms": round(sum(times), 3), "runs": len(times)}
        for (op, provider), times in ranked
    ]


def provider_times(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Each provider's time over the profiled runs, in ms: what ran on the card and what left it."""
    total: dict[str, float] = {}
    for node in nodes:
        total[node["provider"]] = round(total.get(node["provider"], 0.0) + node["ms"], 3)
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.sampler_graph", description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--tokens",
        type=int,
        help="rows of the run's logits (default --rows); more, and the graph gathers the rows among them",
    )
    parser.add_argument("--device", choices=sorted(PROVIDERS), default="cpu", help="the graph's provider")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="write onnxruntime's profile of the graph's runs into DIR and add each kind of node's time, "
        "by provider, to the figures (where a step's time goes, and what left the card)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    figures = bench(
        args.rows, args.vocab, args.repeat, device=args.device, profile=args.profile, tokens=args.tokens
    )
    result = {**figures, "machine": describe()}
    print(
        f"{args.rows} rows, vocabulary {args.vocab}, {result['provider']}; ms a step, median of {args.repeat}"
    )
    for name, figures in result["kinds"].items():
        print(
            f"  {name:24} graph {figures['graph_ms']:8.2f}  RowSampler {figures['row_sampler_ms']:8.2f}"
            f"  rows to the host {figures['host_rows']}"
        )
    print(f"  16 rows to the host: {result['host_rows_16_ms']:.2f} ms")
    for node in result.get("nodes", [])[:15]:
        print(f"  {node['op']:24} {node['provider']:24} {node['ms']:9.2f} ms over {node['runs']} runs")
    for provider, ms in result.get("providers", {}).items():
        print(f"  {provider:49} {ms:9.2f} ms in all")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
