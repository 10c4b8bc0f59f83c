"""Steady-state throughput of a closed-loop run: tokens a second while every stream is generating.

Tokens over the wall time (the first request's send to the last token) counts the run's ramp-up, when
streams still wait for their first token, and its drain, when the streams that have finished their last
request stand idle while the others end theirs: at many streams one long last request can set the wall
time alone. The steady window leaves both out:

- it opens when the last stream to start gets its first token (every stream is generating from then on)
  and closes when the first stream to finish gets the last token of its last request (from then on one
  stream fewer asks for tokens). A stream is one closed-loop client: inside the window it is never idle
  but for the moment between one request's end and the next one's send, which its next request's TTFT
  counts, as a server's clients see it;
- the tokens counted are those that arrived after it opened, up to when it closed, so that N tokens over
  the window's length is a rate; a chunk that carried several tokens (the server's usage counting more
  tokens than text chunks) counts as its request's tokens spread evenly over its chunks.

The figure is null, with the reason, when there is no such window (a stream got its first token only
after another had got its last one: the server never held every stream at once), when it spans less than
MIN_SHARE of the wall time (too short to be a rate of the run), or when no token arrived inside it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

MIN_SHARE = 0.1  # the shortest steady window with a rate, as a share of the wall time


def steady_state(
    requests: Iterable[tuple[int, Sequence[float], int]], started: float, wall_s: float
) -> dict[str, Any]:
    """The steady window of a run of (stream, arrival times of its chunks in order, tokens) requests whose
    first request was sent at `started` (the arrivals' clock) and whose wall time was `wall_s`:
    steady_tokens_per_s (null when the window is empty or too short), steady_from_s (when it opened,
    seconds after `started`), steady_window_s (its length), steady_tokens (the tokens counted in it) and
    steady_reason (why steady_tokens_per_s is null; null when it is not)."""
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    timed: list[tuple[Sequence[float], float]] = []  # each request's arrivals and tokens per arrival
    for stream, arrivals, tokens in requests:
        if not arrivals:
            continue
        firsts[stream] = min(firsts.get(stream, arrivals[0]), arrivals[0])
        lasts[stream] = max(lasts.get(stream, arrivals[-1]), arrivals[-1])
        timed.append((arrivals, tokens / len(arrivals)))
    if not timed:
        return _null("no request got a token")
    opens, closes = max(firsts.values()), min(lasts.values())
    if closes <= opens:
        return _null(
            f"empty: no moment when all {len(firsts)} streams were generating (the last stream's first "
            f"token came {opens - closes:.3f} s after the first stream's last token)"
        )
    counted = sum(
        weight * (bisect.bisect_right(arrivals, closes) - bisect.bisect_right(arrivals, opens))
        for arrivals, weight in timed
    )
    window = closes - opens
    figures: dict[str, Any] = {
        "steady_tokens_per_s": round(counted / window, 2),
        "steady_from_s": round(opens - started, 3),
        "steady_window_s": round(window, 3),
        "steady_tokens": round(counted),
        "steady_reason": None,
    }
    if window < MIN_SHARE * wall_s:
        reason = f"too short: {window:.3f} s of the {wall_s:.3f} s wall time (under {MIN_SHARE:.0%})"
        return figures | {"steady_tokens_per_s": None, "steady_reason": reason}
    if counted <= 0:
        return figures | {"steady_tokens_per_s": None, "steady_reason": "no token arrived inside it"}
    return figures


def _null(reason: str) -> dict[str, Any]:
    return {
        "steady_tokens_per_s": None,
        "steady_from_s": None,
        "steady_window_s": None,
        "steady_tokens": None,
        "steady_reason": reason,
    }
