"""`ortfleet bench serving --models`: closed-loop streams that name different models (a model and its LoRA
adapters), stream i the i-th name of a mix modulo its length. Each run's figures by name, each mix's
tokens/s against the first mix's in the same round, and the random adapters a local fleet can serve."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ortfleet.bench.completions import Served
from ortfleet.bench.stats import summary

RANDOM_RANK = 16  # of the bench's random adapters, on every projection (lora_mix's default)
GOAL_MIXED = 0.8  # a mix's tokens/s over the first mix's at the same streams, at least (issue 70)


def parse_mix(text: str) -> tuple[str, ...]:
    """A comma-separated list of model names, in stream order."""
    names = tuple(part.strip() for part in text.split(","))
    if not names or not all(names):
        raise ValueError(f"{text!r}: give model names separated by commas, e.g. base,sql-lora,chat-lora")
    return names


def parse_adapter(text: str) -> tuple[str, Path]:
    """NAME=PATH, as a worker's --lora takes it."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{text!r}: give NAME=PATH, e.g. sql-lora=/adapters/sql-lora")
    return name.strip(), Path(path.strip()).expanduser()


def check_served(mixes: Sequence[Sequence[str]], model: str, adapters: Sequence[str]) -> None:
    """Every name of the mixes is the local fleet's model or one of its adapters."""
    for name in dict.fromkeys(name for mix in mixes for name in mix):
        if name != model and name not in adapters:
            raise SystemExit(
                f"ortfleet bench serving: --models names {name!r}, which the local fleet does not serve: it "
                f"serves its model as {model!r} and the adapters of --lora and --random-lora "
                f"({', '.join(adapters) or 'none given'})"
            )


def stream_models(mix: Sequence[str], streams: int) -> list[str]:
    return [mix[i % len(mix)] for i in range(streams)]


def random_names(count: int) -> list[str]:
    return [f"random-{i + 1}" for i in range(count)]


def write_random_adapters(model_dir: Path, count: int, folder: Path) -> dict[str, Path]:
    """`count` random adapters for the model (rank RANDOM_RANK, every projection), named random-1, ...,
    in PEFT's files under `folder`."""
    if not count:
        return {}
    from ortfleet.bench.lora_mix import write_random_adapter
    from worker.engines.batcher.lora_graph import LoraGraph

    graph = LoraGraph(model_dir)
    return {
        name: write_random_adapter(folder / name, graph, RANDOM_RANK, seed)
        for seed, name in enumerate(random_names(count))
    }


def by_model(
    results: list[Served], mix: Sequence[str], concurrency: int, wall_s: float
) -> dict[str, dict[str, Any]]:
    """A run's figures for each name its streams sent: its streams, requests and tokens, its tokens over
    the run's wall time (the names' figures add up to the run's), TTFT and ITL."""
    names = stream_models(mix, concurrency)
    out = {}
    for name in dict.fromkeys(names):
        mine = [r for r in results if r.model == name]
        tokens = sum(r.tokens for r in mine)
        out[name] = {
            "streams": names.count(name),
            "requests": len(mine),
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
            "ttft_ms": summary([r.ttft_s for r in mine]),
            "itl_ms": summary([g for r in mine for g in r.gaps]),
        }
    return out


def comparisons(levels: list[dict[str, Any]], mixes: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """Each mix after the first against the first, at each concurrency: its tokens/s over the first's in
    each round (the two ran minutes apart at most), and the median of those ratios."""
    out = []
    first = list(mixes[0])
    for concurrency in dict.fromkeys(level["concurrency"] for level in levels):
        runs = [level for level in levels if level["concurrency"] == concurrency]
        base = {level["round"]: level["tokens_per_s"] for level in runs if level["models"] == first}
        for mix in mixes[1:]:
            ratios = [
                round(level["tokens_per_s"] / base[level["round"]], 4)
                for level in runs
                if level["models"] == list(mix) and base.get(level["round"]) and level["tokens_per_s"]
            ]
            out.append(
                {
                    "concurrency": concurrency,
                    "models": list(mix),
                    "against": first,
                    "ratios": ratios,
                    "median": round(statistics.median(ratios), 4) if ratios else None,
                }
            )
    return out


def first_mix_levels(levels: list[dict[str, Any]], first: Sequence[str]) -> dict[int, dict[str, Any]]:
    """The first mix's run at each concurrency whose tokens/s is the median of its rounds (the lower of the
    two middle ones): the run the serving goals read."""
    out = {}
    for concurrency in dict.fromkeys(level["concurrency"] for level in levels):
        runs = [
            level
            for level in levels
            if level["concurrency"] == concurrency and level.get("models", list(first)) == list(first)
        ]
        if runs:
            ordered = sorted(runs, key=lambda level: level["tokens_per_s"] or 0)
            out[concurrency] = ordered[(len(ordered) - 1) // 2]
    return out


def lines(figures: dict[str, Any]) -> list[str]:
    """Each mixed run's figures by name, then each mix against the first."""
    out = []
    for level in figures["levels"]:
        if named := level.get("by_model"):
            parts = ", ".join(
                f"{name} ({f['streams']} streams) {f['tokens_per_s']} tok/s, TTFT p50 {f['ttft_ms']['p50']}, "
                f"ITL p50 {f['itl_ms']['p50']}"
                for name, f in named.items()
            )
            out.append(f"{level['concurrency']} streams, round {level['round'] + 1}, by model: {parts}")
    for c in figures.get("mixes") or []:
        ratios = ", ".join(f"{r:g}" for r in c["ratios"])
        median = "-" if c["median"] is None else f"{c['median']:g}x"
        out.append(
            f"{c['concurrency']} streams of {','.join(c['models'])} against {','.join(c['against'])}: "
            f"{median} tokens/s (median of the rounds: {ratios or 'none'})"
        )
    return out
