"""The worker's inter-token histogram, observed a job's list of token times at once, exposes what
prometheus_client's Histogram gives for the same gaps observed one by one."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from worker.metrics import INTER_TOKEN_BUCKETS, LABELS, GapHistogram

pytestmark = pytest.mark.unit

NAME = "ortfleet_inter_token_latency_seconds"
VALUES = ("tiny", "cuda:0", "0")


def samples(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if line.startswith(NAME) and "_created" not in line]


def test_a_jobs_gaps_observed_at_once_expose_what_one_observe_each_would() -> None:
    rng = random.Random(7)
    jobs = []
    for _ in range(20):  # gaps in every bucket, on a bound exactly, and past the last
        times, now = [], 1000.0
        for _ in range(rng.randint(0, 60)):
            now += rng.choice([rng.uniform(0, 0.02), rng.uniform(0, 12.0), 0.005, 0.0])
            times.append(now)
        jobs.append(times)

    ours = CollectorRegistry()
    gaps = GapHistogram(NAME, "Time between successive generated tokens.", INTER_TOKEN_BUCKETS, VALUES)
    ours.register(gaps)
    theirs = CollectorRegistry()
    reference = Histogram(
        NAME.removeprefix("ortfleet_"), "Time between successive generated tokens.", LABELS,
        namespace="ortfleet", registry=theirs, buckets=INTER_TOKEN_BUCKETS,
    ).labels(*VALUES)  # fmt: skip
    for times in jobs:
        gaps.observe_gaps(times)
        for earlier, later in itertools.pairwise(times):
            reference.observe(later - earlier)

    expected, got = samples(theirs), samples(ours)
    assert len(expected) == len(INTER_TOKEN_BUCKETS) + 3  # the buckets, +Inf, _count and _sum
    assert [line for line in got if "_sum" not in line] == [line for line in expected if "_sum" not in line]

    def total(lines: list[str]) -> float:
        [line] = [line for line in lines if "_sum" in line]
        return float(line.split()[-1])

    our_sum, their_sum = total(got), total(expected)
    assert math.isclose(our_sum, their_sum, rel_tol=1e-9) and their_sum > 0  # summed in another order
