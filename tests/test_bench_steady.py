"""The serving bench's steady window: tokens a second while every closed-loop stream is generating, on
synthetic arrival times."""

from __future__ import annotations

from typing import Any

import pytest

from ortfleet.bench import serving
from ortfleet.bench.completions import Served, level_figures
from ortfleet.bench.steady import steady_state

pytestmark = pytest.mark.unit


def ticks(first: float, count: int, every: float = 0.01) -> list[float]:
    """`count` arrivals `every` seconds from `first`, rounded so that equal times are equal floats."""
    return [round(first + k * every, 6) for k in range(count)]


def served(stream: int, arrivals: list[float], tokens: int | None = None, index: int = 0) -> Served:
    """A request of `stream` whose chunks came at `arrivals`, sent 0.05 s before the first."""
    tokens = len(arrivals) if tokens is None else tokens
    start = arrivals[0] - 0.05
    return Served(index, tokens, start, 0.05, arrivals[-1], tokens, arrivals=arrivals, stream=stream)


def test_a_long_straggler_sets_the_wall_time_but_not_the_steady_window() -> None:
    # 4 streams, 100 tokens each from 0.1 s, then 50 more each but one, whose last request is 500 long
    results = []
    for stream in range(4):
        results.append(served(stream, ticks(0.1, 100), index=2 * stream))
        results.append(served(stream, ticks(1.1, 500 if stream == 3 else 50), index=2 * stream + 1))
    wall = max(r.end for r in results) - min(r.start for r in results)

    figures = level_figures(results, wall)

    assert figures["output_tokens"] == 4 * 100 + 3 * 50 + 500
    # Opens at the last first token (0.1 s, 0.05 s after the sends), closes at the first stream's last
    # token (1.59 s): each stream's tokens after 0.1 s, up to 1.59 s, are counted: 99 + 50 of each.
    assert figures["steady_from_s"] == 0.05 and figures["steady_window_s"] == 1.49
    assert figures["steady_tokens"] == 4 * 149 and figures["steady_reason"] is None
    assert figures["steady_tokens_per_s"] == pytest.approx(4 * 149 / 1.49, abs=0.01)
    assert figures["steady_tokens_per_s"] > 2 * figures["tokens_per_s"]  # the straggler ran alone 4.5 s


def test_the_window_opens_at_the_last_streams_first_token_and_closes_at_the_first_streams_last() -> None:
    late = [(0, ticks(0.0, 300), 300), (1, ticks(1.0, 100), 100), (2, ticks(0.5, 50) + ticks(1.5, 50), 100)]

    figures = steady_state(late, started=-0.5, wall_s=3.5)

    # opens at 1.0 s (stream 1's first token), closes at 1.99 s (stream 1's and stream 2's last)
    assert figures["steady_from_s"] == 1.5 and figures["steady_window_s"] == 0.99
    # stream 0: 1.01..1.99 (99 tokens); stream 1: 1.01..1.99 (99); stream 2: 1.5..1.99 (50)
    assert figures["steady_tokens"] == 99 + 99 + 50
    assert figures["steady_tokens_per_s"] == pytest.approx(248 / 0.99, abs=0.01)


def test_no_moment_with_every_stream_generating_gives_null_with_the_reason() -> None:
    # stream 1's first token comes 0.5 s after stream 0's last one: the server never held both
    apart = [(0, ticks(0.0, 100), 100), (1, ticks(1.49, 100), 100)]

    figures = steady_state(apart, started=0.0, wall_s=2.5)

    assert figures["steady_tokens_per_s"] is None and figures["steady_window_s"] is None
    assert figures["steady_from_s"] is None and figures["steady_tokens"] is None
    assert figures["steady_reason"].startswith("empty: no moment when all 2 streams were generating")
    assert "0.500 s after" in figures["steady_reason"]
    assert steady_state([], 0.0, 0.0)["steady_reason"] == "no request got a token"


def test_a_window_under_a_tenth_of_the_wall_time_has_no_rate_but_keeps_its_length() -> None:
    # the two streams overlap for 0.2 s of a 3 s run
    brief = [(0, ticks(0.0, 101), 101), (1, ticks(0.8, 221), 221)]

    figures = steady_state(brief, started=0.0, wall_s=3.0)

    assert figures["steady_tokens_per_s"] is None and figures["steady_window_s"] == 0.2
    assert figures["steady_reason"] == "too short: 0.200 s of the 3.000 s wall time (under 10%)"
    assert figures["steady_tokens"] == 20 + 20
    assert steady_state(brief, started=0.0, wall_s=1.9)["steady_tokens_per_s"] == pytest.approx(200)


def test_chunks_of_several_tokens_count_their_requests_tokens_spread_over_them() -> None:
    # one stream, 11 chunks a second apart carrying 101 tokens: each chunk counts 101/11 of them
    figures = steady_state([(0, ticks(0.0, 11, every=1.0), 101)], started=0.0, wall_s=10.0)

    assert figures["steady_window_s"] == 10.0 and figures["steady_tokens"] == round(10 * 101 / 11)
    assert figures["steady_tokens_per_s"] == pytest.approx(101 / 11, abs=0.01)


def bench_figures(levels: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": None,
        "served_name": "bench",
        "server": "local ortfleet fleet (started by the bench)",
        "options": {"requests": 4, "lengths": [4, 12]},
        "engine_alone": None,
        "levels": levels,
        "interference": None,
        "goals": [],
    }


def test_the_table_shows_steady_tokens_per_s_beside_tokens_per_s_and_why_it_is_missing() -> None:
    measured = level_figures([served(0, ticks(0.1, 100)), served(1, ticks(0.1, 100))], 1.05)
    apart = level_figures([served(0, ticks(0.1, 10)), served(1, ticks(1.0, 10))], 1.1)
    old = {k: v for k, v in measured.items() if not k.startswith("steady_")}  # a file from before

    page = serving.text(bench_figures([{"concurrency": 2, **measured}, {"concurrency": 3, **apart}]))
    lines = page.splitlines()

    header = next(line.split() for line in lines if line.split()[:1] == ["run"])
    assert header[:9] == ["run", "streams", "requests", "tokens", "wall", "s", "tok/s", "steady", "tok/s"]
    two = next(line for line in lines if line.split()[:2] == ["ortfleet", "2"]).split()
    assert two[6] == f"{measured['steady_tokens_per_s']:,.2f}"  # right after tok/s
    assert "ortfleet, 3 streams: no steady tok/s, empty: no moment when all 2 streams" in page
    page = serving.text(bench_figures([{"concurrency": 2, **old}]))
    assert next(line for line in page.splitlines() if line.split()[:2] == ["ortfleet", "2"]).split()[6] == "-"
    assert "no steady tok/s" not in page
