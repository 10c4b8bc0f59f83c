"""`ortfleet bench serving --models`: each stream names a model of a list (a model and its LoRA adapters),
each list runs in turns at each concurrency, and the figures come by name as well as in all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ortfleet.bench.completions import Served
from ortfleet.bench.model_mix import by_model, comparisons
from tests.test_bench import bench, figures
from tests.test_bench_http import closing_server  # noqa: F401  (the fixture)
from tests.test_lora import write_adapter


def test_the_serving_bench_runs_each_models_list_in_turns_on_a_fleet_serving_the_adapters_given_and_its_own(
    tiny_model: Path, tmp_path: Path
) -> None:
    sql = write_adapter(tmp_path / "sql", tiny_model, seed=1, strength=2.0)
    out = tmp_path / "serving.json"
    done = bench(
        "serving", "--model", str(tiny_model), "--concurrency", "3", "--requests", "3", "--lengths", "4:8",
        "--no-interference", "--lora", f"sql={sql}", "--random-lora", "1", "--models", "bench",
        "--models", "bench,sql,random-1", "--rounds", "2", "--client-processes", "2", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["options"]["models"] == [["bench"], ["bench", "sql", "random-1"]]
    assert data["options"]["lora"] == {"sql": str(sql)} and data["options"]["random_lora"] == 1
    mixed = ["bench", "sql", "random-1"]
    # Round by round, the lists in turns: the same requests each time.
    assert [(level["models"], level["round"]) for level in data["levels"]] == [
        (["bench"], 0), (mixed, 0), (["bench"], 1), (mixed, 1),
    ]  # fmt: skip
    for level in data["levels"]:
        assert level["requests"] == 6 and level["errors"] == 0
        if level["models"] == ["bench"]:
            assert "by_model" not in level
            continue
        # Stream i names the i-th: one stream each, every name answered, the names' figures adding up.
        named = level["by_model"]
        assert list(named) == mixed and all(f["streams"] == 1 and f["requests"] >= 1 for f in named.values())
        assert sum(f["requests"] for f in named.values()) == level["requests"]
        assert sum(f["output_tokens"] for f in named.values()) == level["output_tokens"]
        rates = sum(f["tokens_per_s"] for f in named.values())
        assert rates == pytest.approx(level["tokens_per_s"], abs=0.05)
        assert all(f["ttft_ms"]["n"] == f["requests"] for f in named.values())
    [compared] = data["mixes"]
    assert compared["concurrency"] == 3 and compared["models"] == mixed and compared["against"] == ["bench"]
    assert len(compared["ratios"]) == 2 and compared["median"] is not None and compared["median"] > 0
    goals = {goal["goal"]: goal for goal in data["goals"]}
    mixed_goal = goals["3 streams of bench,sql,random-1: tokens/s >= 0.8x bench's (median of the rounds)"]
    assert mixed_goal["value"] == compared["median"]
    assert "round 2, by model: bench (1 streams)" in done.stdout
    assert "3 streams of bench,sql,random-1 against bench: " in done.stdout


def test_the_serving_bench_refuses_models_its_fleet_does_not_serve_and_adapters_for_a_server_at_a_url(
    tiny_model: Path,
) -> None:
    def refused(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ortfleet", "bench", "serving", "--model", str(tiny_model), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        return done

    unknown = refused("--random-lora", "1", "--models", "bench,random-1,sql")
    assert "'sql'" in unknown.stderr and "random-1" in unknown.stderr and "engine alone" not in unknown.stderr
    assert "--lora" in refused("--url", "http://127.0.0.1:9/v1", "--lora", "sql=/x").stderr
    assert "separated by commas" in refused("--models", "bench,,sql").stderr
    assert "NAME=PATH" in refused("--lora", "sql").stderr


def test_each_stream_names_its_model_from_the_list_across_client_processes(
    closing_server: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "serving.json"
    bench(
        "serving", "--url", closing_server, "--no-interference", "--concurrency", "4", "--requests", "8",
        "--lengths", "4:4", "--models", "a,b,c", "--client-processes", "2", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["served_name"] == "a"  # the first name: the interference's, had it run
    [level] = data["levels"]
    named = level["by_model"]
    # Clients 0 and 1 in the first process, 2 and 3 in the second: a, b, c, a.
    assert {name: f["streams"] for name, f in named.items()} == {"a": 2, "b": 1, "c": 1}
    assert sum(f["requests"] for f in named.values()) == 8 and data["mixes"] is None


def served(stream: int, model: str, tokens: int) -> Served:
    return Served(0, tokens, 0.0, 0.1, 1.0, tokens, [0.01] * (tokens - 1), stream=stream, model=model)


@pytest.mark.unit
def test_a_runs_figures_by_name_count_each_names_streams_and_share_the_runs_wall_time() -> None:
    results = [served(0, "base", 10), served(1, "sql", 20), served(2, "base", 30), served(0, "base", 10)]

    named = by_model(results, ["base", "sql"], 3, 2.0)

    assert named["base"]["streams"] == 2 and named["sql"]["streams"] == 1
    assert (named["base"]["requests"], named["base"]["output_tokens"], named["base"]["tokens_per_s"]) == (
        3, 50, 25.0,
    )  # fmt: skip
    assert named["sql"]["itl_ms"]["n"] == 19


@pytest.mark.unit
def test_each_list_after_the_first_is_set_against_the_first_round_by_round() -> None:
    def run(models: list[str], round_: int, rate: float) -> dict[str, object]:
        return {"concurrency": 8, "models": models, "round": round_, "tokens_per_s": rate}

    mixed = ["base", "a"]
    levels = [run(["base"], 0, 100.0), run(mixed, 0, 90.0), run(["base"], 1, 50.0), run(mixed, 1, 45.0)]
    levels += [run(["base"], 2, 100.0), run(mixed, 2, 70.0)]

    [compared] = comparisons(levels, [("base",), ("base", "a")])

    # Each round against its own base run: a slower round's base does not count against the mix.
    assert compared["ratios"] == [0.9, 0.9, 0.7] and compared["median"] == 0.9
