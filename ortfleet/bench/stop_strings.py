"""The worker's stop-string matcher per token, in this process.

`python -m ortfleet.bench.stop_strings [--tokens N] [--repeat R] [--seed S] [--json FILE]` feeds
worker/stop_strings.py's StopMatcher a stream of `--tokens` (200,000) pieces of 1-8 characters, as the
job runner does with each detokenized token, for 1, 2 and 4 stop strings, and prints the microseconds
per token (the best of `--repeat` (5) passes, the loop's own cost included), and the same for
ScanningMatcher, the matcher as it was before its fast path (every piece scans the held-back text):
- `none`: English-like pieces with newlines, digits and punctuation, some that begin a stop string
  (`\\n`, `User`, `#`, `<|`), none completing one: the common case;
- `stops`: the same stream with a stop string every 64 tokens on average, split over one to three
  pieces; each stop ends a job, and the next piece starts a new matcher.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from worker.stop_strings import StopMatcher

STOP_SETS: dict[str, list[str]] = {
    "1 stop": ["</answer>"],
    "2 stops": ["\nUser:", "###"],
    "4 stops": ["<|im_end|>", "Observation:", "\n\n\n", "STOP"],
}
WORDS = (
    "the model serves tokens to every client of the fleet while its workers claim jobs from Redis and "
    "write each step as one script call a user asks for an answer in markdown with # headings code and "
    "lists of 42 items at 3.5 ms a step Observation is what the tool said and the answer ends here STO"
).split()
PUNCTUATION = [",", ".", ":", "\n", "\n\n", " (", ")", "'s", "!", "?", " #", " <|", " User"]


class Matcher(Protocol):
    def feed(self, piece: str) -> tuple[str, bool]: ...


class ScanningMatcher:
    """StopMatcher before its fast path, kept to compare with: every piece scans the text held back
    with it for each stop string, then for each stop's overlap with the text's end."""

    def __init__(self, stops: list[str], *, keep_stop: bool = False) -> None:
        self._stops = stops
        self._keep_stop = keep_stop
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self._pending + piece
        hits = [(i, len(stop)) for stop in self._stops if (i := text.find(stop)) >= 0]
        if hits:
            self._pending = ""
            start, size = min(hits)
            return text[: start + size if self._keep_stop else start], True
        keep = max((self._overlap(text, stop) for stop in self._stops), default=0)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        for size in range(min(len(text), len(stop) - 1), 0, -1):
            if stop.startswith(text[-size:]):
                return size
        return 0


def pieces(count: int, rng: random.Random) -> list[str]:
    """Pieces as a tokenizer's stream decoder gives them: words with their leading space (split in
    two when long), punctuation and newlines, each of 1-8 characters."""
    out: list[str] = []
    while len(out) < count:
        if rng.random() < 0.2:
            out.append(rng.choice(PUNCTUATION))
            continue
        word = " " + rng.choice(WORDS)
        parts = [word]
        if len(word) > 5 and rng.random() < 0.3:
            cut = rng.randrange(2, len(word) - 1)
            parts = [word[:cut], word[cut:]]
        out += [part[i : i + 8] for part in parts for i in range(0, len(part), 8)]
    return out[:count]


def stream(stops: list[str], count: int, rng: random.Random, every: int | None) -> list[str]:
    """`count` pieces that complete no stop string, or (every: N) complete one every N pieces on
    average, its text split over one to three pieces."""
    out: list[str] = []
    text = ""
    for piece in pieces(count * 2, rng):
        if len(out) >= count:
            break
        if every is not None and rng.random() < 1 / every:
            stop = rng.choice(stops)
            cuts = sorted(rng.sample(range(1, len(stop)), min(rng.randrange(3), len(stop) - 1)))
            out += [stop[a:b] for a, b in zip([0, *cuts], [*cuts, len(stop)], strict=True)]
            text = ""
            continue
        tail = text[-64:] + piece
        if any(stop in tail for stop in stops):
            continue
        out.append(piece)
        text = tail
    return out[:count]


def time_feed(make: Callable[[], Matcher], stream_pieces: list[str], repeat: int) -> float:
    """Microseconds per piece: the best of `repeat` passes over the stream, a new matcher after each
    stop (a new job)."""
    best = float("inf")
    for _ in range(repeat):
        matcher = make()
        feed = matcher.feed
        start = time.perf_counter_ns()
        for piece in stream_pieces:
            if feed(piece)[1]:
                feed = make().feed
        best = min(best, time.perf_counter_ns() - start)
    return best / len(stream_pieces) / 1000


def run(tokens: int, repeat: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    figures: dict[str, Any] = {}
    matchers: dict[str, type[StopMatcher] | type[ScanningMatcher]] = {
        "matcher": StopMatcher,
        "scan": ScanningMatcher,
    }
    for name, stops in STOP_SETS.items():
        row: dict[str, Any] = {"stops": stops}
        for kind, every in (("none", None), ("stops", 64)):
            pieces = stream(stops, tokens, rng, every)
            for label, matcher in matchers.items():
                make = lambda matcher=matcher, stops=stops: matcher(stops)  # noqa: E731
                row[f"{label}_{kind}_us_per_token"] = round(time_feed(make, pieces, repeat), 3)
        figures[name] = row
    return {"tokens": tokens, "repeat": repeat, "seed": seed, "python": sys.version.split()[0], **figures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.stop_strings", description=__doc__)
    parser.add_argument("--tokens", type=int, default=200_000, help="pieces in each stream (200,000)")
    parser.add_argument("--repeat", type=int, default=5, help="passes over each stream; the best counts")
    parser.add_argument("--seed", type=int, default=0, help="the streams' random seed")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    result = run(args.tokens, args.repeat, args.seed)
    for name in STOP_SETS:
        row = result[name]
        print(
            f"{name:8} µs a token: without a stop {row['matcher_none_us_per_token']:.3f} "
            f"(full scan {row['scan_none_us_per_token']:.3f}), a stop every 64 tokens "
            f"{row['matcher_stops_us_per_token']:.3f} (full scan {row['scan_stops_us_per_token']:.3f})  "
            f"{row['stops']!r}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
