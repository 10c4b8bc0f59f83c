"""The stop-string matcher: its fast path for pieces that cannot take part in a match gives exactly what
a full scan of the text gives (the bench's ScanningMatcher, the matcher as it was), on random streams
(seeded), stops spanning several pieces included."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ortfleet.bench import stop_strings as bench
from ortfleet.bench.stop_strings import ScanningMatcher
from worker.stop_strings import StopMatcher

pytestmark = pytest.mark.unit


# Few characters, so that stops begin, overlap and complete often; unicode beyond the BMP included.
ALPHABET = "ab\n #é€𝄞"


def assert_same(stops: list[str], pieces: list[str], keep_stop: bool) -> None:
    fast, scan = StopMatcher(stops, keep_stop=keep_stop), ScanningMatcher(stops, keep_stop=keep_stop)
    for piece in pieces:
        assert fast.feed(piece) == scan.feed(piece), (stops, pieces, piece)
    assert fast.flush() == scan.flush()


@settings(max_examples=600, derandomize=True, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
    pieces=st.lists(st.text(ALPHABET, max_size=8), max_size=40),
    keep_stop=st.booleans(),
)
def test_the_fast_path_gives_what_a_full_scan_gives(
    stops: list[str], pieces: list[str], keep_stop: bool
) -> None:
    assert_same(stops, pieces, keep_stop)


def test_stops_spanning_several_pieces_on_seeded_random_streams() -> None:
    rng = random.Random(57)
    for _ in range(2000):
        stops = ["".join(rng.choices(ALPHABET, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        # text with stops (or their beginnings) in it, cut into pieces of 0-8 characters
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            stop = rng.choice(stops)
            if roll < 0.3:
                parts.append(stop)
            elif roll < 0.5:
                parts.append(stop[: rng.randint(1, len(stop))])
            else:
                parts.append("".join(rng.choices(ALPHABET, k=rng.randint(0, 6))))
        text = "".join(parts)
        pieces = []
        at = 0
        while at < len(text):
            size = rng.randint(0, 8)
            pieces.append(text[at : at + size])
            at += size
        assert_same(stops, pieces, rng.random() < 0.5)


@pytest.mark.parametrize(
    ("stops", "pieces", "keep_stop", "fed"),
    [
        # a stop over three pieces: its beginning held back, then cut
        (
            ["</answer>"],
            ["It is 4", "</ans", "wer", ">!"],
            False,
            [("It is 4", False), ("", False), ("", False), ("", True)],
        ),
        (
            ["</answer>"],
            ["It is 4", "</ans", "wer", ">!"],
            True,
            [("It is 4", False), ("", False), ("", False), ("</answer>", True)],
        ),
        # a held-back beginning that turns out not to be a stop is emitted with the next piece
        (["\nUser:"], ["Hi", "\nUs", "ed it"], False, [("Hi", False), ("", False), ("\nUsed it", False)]),
        # the first of two stops in the text wins, whatever their order in the list
        (["b", "#a"], ["x#ab"], False, [("x", True)]),
        # unicode: characters, not bytes
        (["€𝄞"], ["a€", "𝄞b"], True, [("a", False), ("€𝄞", True)]),
    ],
)
def test_examples(stops: list[str], pieces: list[str], keep_stop: bool, fed: list[tuple[str, bool]]) -> None:
    matcher = StopMatcher(stops, keep_stop=keep_stop)
    assert [matcher.feed(piece) for piece in pieces] == fed


def test_held_back_text_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.feed("title ##") == ("title ", False)
    assert matcher.flush() == "##"


def test_the_bench_streams_complete_a_stop_only_where_asked() -> None:
    rng = random.Random(1)
    for stops in bench.STOP_SETS.values():
        clean = bench.stream(stops, 2000, rng, None)
        assert len(clean) == 2000 and all(1 <= len(piece) <= 8 for piece in clean)
        assert not any(stop in "".join(clean) for stop in stops)
        assert any(stop in "".join(bench.stream(stops, 2000, rng, 64)) for stop in stops)
    figures = bench.run(tokens=300, repeat=1, seed=2)
    assert set(figures["2 stops"]) == {
        "stops",
        *(f"{m}_{k}_us_per_token" for m in ("matcher", "scan") for k in ("none", "stops")),
    }
