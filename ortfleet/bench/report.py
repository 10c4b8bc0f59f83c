"""Benchmark figures: the header of a run's context, tables, JSON, and the fleet benchmark's plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ortfleet.bench.machine import describe


def figures_header(
    bench: str,
    command_line: str,
    load_at_start: tuple[float, float, float],
    model_dir: Path | None,
    options: dict[str, Any],
    *,
    server: str | None = None,
    served_name: str | None = None,
) -> dict[str, Any]:
    """What the figures of a run against a server open with: the bench, its command line, the machine,
    the load average at the start and now (the end), the model folder, the server and the name it
    serves the model as (where the bench has one), and the bench's options."""
    header: dict[str, Any] = {
        "bench": bench,
        "command_line": command_line,
        "machine": describe(),
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "model": str(model_dir) if model_dir is not None else None,
    }
    if server is not None:
        header |= {"server": server, "served_name": served_name}
    return header | {"options": options}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def write_json(path: Path, figures: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")


def fleet_table(figures: dict[str, Any]) -> str:
    headers = ["conc", "mode", "tok/s", "req/s", "TTFT p50", "p95", "p99", "ITL p50", "ITL p99"]
    rows: list[list[Any]] = []
    for level in figures["levels"]:
        for mode in ("direct", "fleet"):
            f = level[mode]
            rows.append(
                [
                    level["concurrency"],
                    mode,
                    f["tokens_per_s"],
                    f["requests_per_s"],
                    f["ttft_ms"]["p50"],
                    f["ttft_ms"]["p95"],
                    f["ttft_ms"]["p99"],
                    f["itl_ms"]["p50"],
                    f["itl_ms"]["p99"],
                ]
            )
        c = level["fleet_vs_direct"]
        rows.append(
            [
                "",
                "ratio/+ms",
                _ratio(c["tokens_per_s"]),
                _ratio(c["requests_per_s"]),
                _added(c["ttft_added_ms"]["p50"]),
                "",
                _added(c["ttft_added_ms"]["p99"]),
                _added(c["itl_added_ms"]["p50"]),
                _added(c["itl_added_ms"]["p99"]),
            ]
        )
    goals = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in figures["goals"].items())
    rounds = "; ".join(
        f"{level['concurrency']}: "
        + " ".join(f"{r:.3f}" for r in level["fleet_vs_direct"]["tokens_per_s_by_round"])
        for level in figures["levels"]
    )
    pinning = figures.get("pinning")
    pinned = (
        f"\npinned: engine on cores {pinning['engine_cores']}, the rest on {pinning['other_cores']}"
        if pinning
        else ""
    )
    interval = figures.get("stream_interval")
    grouped = f"\nstream interval: {interval} tokens a write" if interval and interval > 1 else ""
    return (
        f"{table(headers, rows)}\n(latencies in ms; ratio = fleet/direct)\n"
        f"tokens/s ratio of each round, by concurrency: {rounds}\ngoals: {goals}{pinned}{grouped}\n\n"
        f"{cpu_table(figures)}\n\n{ttft_parts_table(figures)}"
    )


TTFT_PARTS = ("submission_to_claim", "claim_to_first_token", "delivery_and_post")


def ttft_parts_table(figures: dict[str, Any]) -> str:
    """The fleet's TTFT p50 by part, beside the direct run's whole TTFT p50, by concurrency."""
    rows = []
    for level in figures["levels"]:
        parts = level["fleet"].get("ttft_parts_ms", {})
        p50s = [parts.get(part, {}).get("p50") for part in TTFT_PARTS]
        rows.append(
            [level["concurrency"], *p50s, level["fleet"]["ttft_ms"]["p50"], level["direct"]["ttft_ms"]["p50"]]
        )
    headers = ["conc", "to claim", "claim to 1st token", "delivery + POST", "fleet TTFT", "direct TTFT"]
    note = (
        "(TTFT p50 in ms; the fleet's by part, from each job's record: submission to the worker taking it,\n"
        " from there to the engine's first token in the worker, and the rest: the POST and the relay)"
    )
    return f"{table(headers, rows)}\n{note}"


CPU_COLUMNS = ("gateway", "worker_loop", "redis", "fleet_overhead", "client", "worker_engine")
WAKEUP_COLUMNS = ("gateway", "worker_loop", "redis")


def cpu_table(figures: dict[str, Any]) -> str:
    """CPU ms per generated token of each fleet process, by concurrency."""
    rows = []
    for level in figures["levels"]:
        cpu = level["fleet"].get("cpu_ms_per_token", {})
        rows.append([level["concurrency"], *(cpu.get(column) for column in CPU_COLUMNS)])
    headers = ["conc", "gateway", "worker loop", "redis", "overhead", "client", "engine"]
    note = "(fleet CPU ms per generated token; overhead = gateway + worker loop + redis)"
    woken = [level for level in figures["levels"] if "wakeups_per_token" in level["fleet"]]
    if not woken:
        return f"{table(headers, rows)}\n{note}"
    wakeup_rows = [
        [level["concurrency"], *(level["fleet"]["wakeups_per_token"].get(c) for c in WAKEUP_COLUMNS)]
        for level in woken
    ]
    wakeup_note = "(wake-ups per generated token: times each process's main thread slept and was woken)"
    return (
        f"{table(headers, rows)}\n{note}\n\n"
        f"{table(['conc', 'gateway', 'worker loop', 'redis'], wakeup_rows)}\n{wakeup_note}"
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _added(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def plot_fleet(figures: dict[str, Any], path: Path) -> None:
    """Tokens/s and TTFT against concurrency, fleet beside direct."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = figures["levels"]
    x = [level["concurrency"] for level in levels]
    fig, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    positions = range(len(x))
    for offset, mode, color in ((-width / 2, "direct", "#4c72b0"), (width / 2, "fleet", "#dd8452")):
        values = [level[mode]["tokens_per_s"] or 0 for level in levels]
        throughput.bar([p + offset for p in positions], values, width, label=mode, color=color)
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ttft.plot(
                list(positions),
                [level[mode]["ttft_ms"][q] for level in levels],
                style,
                color=color,
                label=f"{mode} {q}",
            )
    for axis in (throughput, ttft):
        axis.set_xticks(list(positions), [str(c) for c in x])
        axis.set_xlabel("concurrent streams")
        axis.grid(axis="y", alpha=0.3)
        axis.legend()
    throughput.set_ylabel("output tokens/s (all streams)")
    throughput.set_title("Aggregate throughput")
    ttft.set_ylabel("time to first token (ms)")
    ttft.set_yscale("log")
    ttft.set_title("TTFT")
    machine = figures["machine"]
    fig.suptitle(
        f"ortfleet vs its engine in-process: {Path(figures['model']).name}, "
        f"{figures['max_tokens']} tokens/request, {machine['cores']} cores ({machine['cpu']})",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
