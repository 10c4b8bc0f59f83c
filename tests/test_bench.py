"""`ortfleet bench` in each mode with tiny parameters: it runs and writes every figure (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ortfleet.bench.backends import FleetBackend
from ortfleet.bench.capacity import WRITERS
from ortfleet.bench.sse import SseEvent


def bench(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ortfleet", "bench", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()  # the bench stops the fleet it started, and says where it was
            stdout, stderr = process.communicate(timeout=60)
            raise AssertionError(f"ortfleet bench ran past {timeout_s:g} s:\n{stderr[-3000:]}") from None
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def figures(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def assert_summary(summary: dict[str, Any], count: int | None = None) -> None:
    assert set(summary) == {"p50", "p95", "p99", "max", "mean", "n"}
    assert summary["p50"] is not None and summary["p50"] <= summary["p99"] <= summary["max"]
    if count is not None:
        assert summary["n"] == count


def test_the_fleet_bench_compares_the_fleet_with_its_engine_and_writes_json_and_a_plot(
    tiny_model: Path, tmp_path: Path
) -> None:
    out, plot = tmp_path / "fleet.json", tmp_path / "fleet.png"
    done = bench(
        "--model", str(tiny_model), "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8",
        "--json", str(out), "--plot", str(plot),
    )  # fmt: skip

    data = figures(out)
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        for mode in ("direct", "fleet"):
            side = level[mode]
            assert side["requests"] == 4 and side["errors"] == 0
            assert side["output_tokens"] == 4 * 8  # min_tokens = max_tokens: every request does the same work
            assert side["tokens_per_s"] > 0 and side["requests_per_s"] > 0
            assert_summary(side["ttft_ms"], 4)
            assert_summary(side["itl_ms"], 4 * 7)
        ratio = level["fleet_vs_direct"]
        assert ratio["tokens_per_s"] > 0 and ratio["requests_per_s"] > 0
        assert len(ratio["tokens_per_s_by_round"]) == 1 and ratio["tokens_per_s_median_of_rounds"] > 0
        assert all(level[side]["engine_batch_rows_mean"] >= 1 for side in ("direct", "fleet"))
        cpu = level["fleet"]["cpu_ms_per_token"]
        assert {"gateway", "redis", "worker_loop", "worker_engine", "client", "fleet_overhead"} <= set(cpu)
        assert cpu["fleet_overhead"] == pytest.approx(
            cpu["gateway"] + cpu["worker_loop"] + cpu["redis"], abs=0.001
        )
        wakeups = level["fleet"]["wakeups_per_token"]  # each token wakes each of them, mostly
        assert set(wakeups) == {"gateway", "worker_loop", "redis"} and min(wakeups.values()) > 0
        assert set(ratio["ttft_added_ms"]) == {"p50", "p99"} and set(ratio["itl_added_ms"]) == {"p50", "p99"}
        parts = level["fleet"]["ttft_parts_ms"]  # from each job's record
        assert set(parts) == {"submission_to_claim", "claim_to_first_token", "delivery_and_post"}
        for part in parts.values():
            assert_summary(part, 4)
            assert part["p50"] > 0
        # The parts add up to each request's TTFT, so their p50s come near the whole one.
        assert sum(part["p50"] for part in parts.values()) == pytest.approx(side["ttft_ms"]["p50"], rel=0.5)
    assert set(data["goals"]) == {
        "tokens_per_s_ratio>=0.97",
        "ttft_added_p50<=5.0ms",
        "ttft_added_p99<=20.0ms",
        "itl_added_p50<=1.0ms",
    }
    assert set(data["single_stream_tokens_per_s"]) == {"direct", "fleet"}
    assert data["machine"]["cores"] >= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ratio" in done.stdout and "goals:" in done.stdout and "overhead" in done.stdout
    assert "claim to 1st token" in done.stdout
    assert data["pinning"] is None and data["stream_interval"] == 1 and data["api"] == "jobs"


def bench_through(api: str, model: Path, tmp_path: Path) -> dict[str, Any]:
    """The fleet figures of a small bench whose clients ask through `api`, checked for what every API
    gives: no error, a TTFT per request, CPU per process, and each request's job record found."""
    out = tmp_path / f"{api}.json"
    bench(
        "--api", api, "--model", str(model), "--concurrency", "2", "--requests", "4",
        "--max-tokens", "8", "--json", str(out),
    )  # fmt: skip
    data = figures(out)
    assert data["api"] == api
    [level] = data["levels"]
    fleet: dict[str, Any] = level["fleet"]
    assert fleet["errors"] == 0
    assert_summary(fleet["ttft_ms"], 4)
    assert {"gateway", "redis", "worker_loop", "fleet_overhead"} <= set(fleet["cpu_ms_per_token"])
    assert min(fleet["wakeups_per_token"].values()) > 0
    for part in fleet["ttft_parts_ms"].values():  # each request's job record was found
        assert_summary(part, 4)
    return fleet


def test_the_fleet_bench_can_ask_for_streamed_openai_completions(tiny_model: Path, tmp_path: Path) -> None:
    fleet = bench_through("completions", tiny_model, tmp_path)
    assert fleet["output_tokens"] == 4 * 8  # the usage chunks' count
    assert 0 < fleet["itl_ms"]["n"] <= 4 * 7  # a chunk per token with text


@pytest.mark.default_model
def test_the_fleet_bench_can_ask_for_streamed_responses(default_model: Path, tmp_path: Path) -> None:
    """On the default model: greedy, the tiny model's random weights may end a response at once."""
    fleet = bench_through("responses", default_model, tmp_path)
    assert 4 <= fleet["output_tokens"] <= 4 * 8  # the final usages' count
    assert 0 < fleet["itl_ms"]["n"] <= 4 * 7  # a delta per token with text


class ScriptedStream:
    """A bench client connection whose stream says what the test gives it."""

    def __init__(self, *payloads: object) -> None:
        self.frames = [json.dumps(p) if isinstance(p, dict) else str(p) for p in payloads]

    async def events(self, path: str, payload: Any = None) -> AsyncIterator[SseEvent]:
        for i, data in enumerate(self.frames):
            yield SseEvent("", "message", data, 100.0 + i)


async def test_a_streamed_completion_or_response_without_text_arrives_with_its_end() -> None:
    """A sampled model may stream tokens whose text is all held back (no text chunk at all): the bench
    counts the request, arriving with its finish, rather than failing the run."""
    usage = {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    choice = {"index": 0, "text": "", "logprobs": None}
    silent_completion = ScriptedStream(
        {"id": "cmpl-job_a", "choices": [{**choice, "finish_reason": None}]},
        {"id": "cmpl-job_a", "choices": [{**choice, "finish_reason": "length"}]},
        {"id": "cmpl-job_a", "choices": [], "usage": usage},
        "[DONE]",
    )
    created = {"type": "response.created", "response": {"id": "resp_b"}}
    ended = {"type": "response.incomplete", "response": {"usage": {"output_tokens": 8}}}
    backend = FleetBackend("http://unused", "m", 8, api="completions")
    completion = await backend.generate(silent_completion, "Hi")  # type: ignore[arg-type]
    response = await FleetBackend("http://unused", "m", 8, api="responses").generate(
        ScriptedStream(created, ended),  # type: ignore[arg-type]
        "Hi",
    )
    assert (completion.tokens, completion.job_id, completion.gaps) == (8, "job_a", [])
    assert (response.tokens, response.job_id, response.gaps) == (8, "job_b", [])
    spoken = ScriptedStream(
        {"id": "cmpl-job_c", "choices": [{**choice, "text": "x", "finish_reason": None}]},
        {"id": "cmpl-job_c", "choices": [{**choice, "finish_reason": "length"}]},
        {"id": "cmpl-job_c", "choices": [], "usage": usage},
    )
    assert (await backend.generate(spoken, "Hi")).gaps == []  # type: ignore[arg-type]  # the finish is no token


def test_the_pinned_fleet_bench_puts_the_engine_on_cores_of_its_own_and_sets_the_stream_interval(
    tiny_model: Path, tmp_path: Path
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning needs at least two cores")
    out = tmp_path / "pinned.json"
    done = bench(
        "--pin", "--engine-cores", "1", "--model", str(tiny_model), "--concurrency", "2", "--requests", "4",
        "--max-tokens", "8", "--stream-interval", "3", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    cores = sorted(os.sched_getaffinity(0))
    assert data["pinning"] == {"engine_cores": cores[-1:], "other_cores": cores[:-1]}
    [level] = data["levels"]
    assert level["fleet"]["errors"] == 0 and level["fleet"]["output_tokens"] == 4 * 8
    assert level["direct"]["output_tokens"] == 4 * 8
    assert "pinned: engine on cores" in done.stdout
    assert data["stream_interval"] == 3 and "stream interval: 3 tokens a write" in done.stdout


@pytest.mark.parametrize("writer", ["step", "plain"])
def test_the_gateway_bench_holds_streams_relays_every_event_and_counts_submissions(
    tmp_path: Path, writer: str
) -> None:
    out = tmp_path / "gateway.json"
    done = bench(
        "gateway", "--streams", "200", "--rate", "2", "--duration", "2", "--submissions", "200",
        "--writer", writer, "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["options"]["writer"] == writer and WRITERS[writer] in done.stdout
    streams = data["streams"]
    if writer == "step":  # the notices carry the entries: no read but a sweep's (one every 5 s)
        assert streams["relay_reads"] <= 2
    else:  # a read for each notice, some of them taking several
        assert streams["relay_reads"] >= 20
    assert streams["open_streams"] == 200 and streams["streams_failed"] == 0
    assert streams["events_published"] > 0
    assert streams["events_received"] == streams["events_published"]
    assert_summary(streams["relay_latency_ms"], streams["events_received"])
    assert streams["memory_per_stream_kb"] is not None
    assert 1 <= streams["redis_connections"]["max_while_relaying"] <= 8  # 200 streams, 8 connections at most
    for pauses in streams["gc_pauses"].values():  # read from the gateway's ortfleet_gc_pause_seconds
        assert 0 <= pauses["full"] <= pauses["collections"]
        assert 0 <= pauses["over_50ms"] <= pauses["collections"] and pauses["seconds"] >= 0
    by_second = streams["relay_latency_p99_ms_by_second"]
    assert 2 <= len(by_second) <= 3 and all(
        p99 is not None and p99 <= streams["relay_latency_ms"]["max"] for p99 in by_second
    )
    submissions = data["submissions"]
    assert submissions["submitted"] == 200 and submissions["per_s"] > 0
    assert_summary(submissions["latency_ms"], 200)


def test_the_gateway_bench_refuses_more_streams_than_one_process_may_hold_open_files_for() -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    command = [sys.executable, "-m", "ortfleet", "bench", "gateway", "--streams", str(hard)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"one process may hold at most {hard} open files" in done.stderr
    assert "ulimit -Hn" in done.stderr


def test_the_simulation_reports_token_shares_queue_waits_and_idle_time(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    bench("sim", "--workers", "20:1,10:2,10:1", "--duration", "4", "--max-tokens", "8", "--json", str(out))

    data = figures(out)
    workers = data["workers"]
    assert [(w["delay_ms"], w["capacity"]) for w in workers] == [(20, 1), (10, 1), (10, 2)]  # slowest first
    assert sum(w["token_share"] for w in workers) == pytest.approx(1, abs=0.01)
    assert sum(w["expected_share"] for w in workers) == pytest.approx(1, abs=0.01)
    assert [w["expected_share"] for w in workers] == pytest.approx([1 / 7, 2 / 7, 4 / 7], abs=0.01)
    assert all(w["idle_while_jobs_waited_ms"] >= 0 and w["idle_gaps"] >= 0 for w in workers)
    assert data["clients"] == 6  # 1.5x the 4 slots: jobs always wait
    assert data["jobs"] > 0
    assert_summary(data["queue_wait_ms"])


def test_the_pickup_bench_times_sequential_jobs_on_an_idle_worker(tmp_path: Path) -> None:
    out = tmp_path / "pickup.json"
    bench("pickup", "--fake-engine", "5:1", "--jobs", "10", "--json", str(out))

    data = figures(out)
    assert_summary(data["queue_wait_ms"], 10)
    assert_summary(data["client_submit_to_running_ms"], 10)


def test_the_batching_bench_checks_each_candidates_greedy_tokens_and_times_its_decode_steps(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "batching.json"
    done = bench(
        "batching", "--model", str(tiny_model), "--batch-sizes", "1,2", "--past-lengths", "8,16",
        "--steps", "2", "--tokens", "6", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    candidates = ["session-run", "session-bound", "session-shared", "generators", "og-batch"]
    assert data["bench"] == "batching" and data["candidates"] == candidates
    for name in candidates:  # every prompt's tokens were compared with its lone og.Generator's
        check = data["correctness"][name]
        assert check["rows"] == len(check["rows_detail"]) >= 4 and check["tokens"] > 0
        assert 0 <= check["rows_equal"] <= check["rows"] and 0 <= check["tokens_equal"] <= check["tokens"]
        assert f"{check['rows_equal']}/{check['rows']}" in done.stdout
    shared = data["correctness"]["session-shared"]  # the shared KV buffer: rows join and leave exactly
    assert shared["rows_equal"] == shared["rows"]
    assert [(t["past_length"], t["batch"]) for t in data["timing"]] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for entry in data["timing"]:
        assert set(entry["candidates"]) == set(candidates)
        for side in entry["candidates"].values():
            assert side["ms_per_step"] > 0 and side["tokens_per_s"] > 0
            assert side["tokens_per_s_vs_lone_generator"] > 0 and side["ms_per_step_vs_og_batch"] > 0


def test_bench_options_are_checked() -> None:
    command = [sys.executable, "-m", "ortfleet", "bench", "--concurrency", "0,2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "positive" in done.stderr
    bad_sim = [sys.executable, "-m", "ortfleet", "bench", "sim", "--workers", "fast"]
    done = subprocess.run(bad_sim, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DELAY_MS:CAPACITY" in done.stderr
    bad_api = [sys.executable, "-m", "ortfleet", "bench", "--api", "chat"]
    done = subprocess.run(bad_api, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--api: invalid choice: 'chat'" in done.stderr


def test_a_terminated_bench_stops_the_fleet_it_started() -> None:
    command = [sys.executable, "-m", "ortfleet", "bench", "redis", "--jobs", "1000000", "--json", os.devnull]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as process:
        bench_process = psutil.Process(process.pid)
        deadline = time.monotonic() + 120
        while len(children := bench_process.children()) < 3:  # Redis, the gateway and the worker
            assert process.poll() is None and time.monotonic() < deadline, "the bench never ran its fleet"
            time.sleep(0.1)
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    _, running = psutil.wait_procs(children, timeout=10)
    assert not running, f"left running: {[child.cmdline() for child in running]}\n{stderr[-2000:]}"


def test_the_serving_benchs_engine_alone_runs_and_ends_in_a_process_of_its_own(tiny_model: Path) -> None:
    """og.Engine keeps a GPU's KV cache until its process ends: the engine alone's must have ended before
    the fleet's workers start, or they start short of memory (or not at all)."""
    from ortfleet.bench.completions import Planned
    from ortfleet.bench.engine_alone import engine_alone

    levels, shape = engine_alone(tiny_model, [(1, [Planned(0, "Hello", 4)])], "cpu")

    assert levels[0]["output_tokens"] == 4 and shape["engine"] == "BatchingEngine"
    assert shape["pid"] != os.getpid() and not psutil.pid_exists(shape["pid"])


def test_the_serving_bench_measures_the_engine_alone_the_fleet_at_each_concurrency_and_interference(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serving.json"
    done = bench(
        "serving", "--model", str(tiny_model), "--concurrency", "1,2", "--requests", "2",
        "--long-prompt-tokens", "200", "--lengths", "4:12", "--gateways", "2", "--client-processes", "2",
        "--workers", "2", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["bench"] == "serving" and "bench serving" in data["command_line"]
    assert data["machine"]["cores"] >= 1 and data["served_name"] == "bench"
    assert data["options"]["gateways"] == 2 and data["options"]["client_processes"] == 2
    # Each level names the fleet's workers, their rows and the tokens each generated in it: all of them.
    for level in data["levels"]:
        assert (level.pop("models"), level.pop("round")) == (["bench"], 0)  # one list: the model alone
        workers = level.pop("workers")
        assert len(workers) == 2 and all(w["device"] == "cpu" and w["rows"] >= 1 for w in workers)
        assert sum(w["tokens"] for w in workers) == level["output_tokens"]
    assert "streams, tokens by worker: cpu" in done.stdout
    planned = [request["max_tokens"] for request in data["requests"]]
    # --requests 2, and two for each client: 2 at one stream, the list's 4 at two streams
    assert len(planned) == 4 and all(4 <= tokens <= 12 for tokens in planned)

    def every_figure_is_a_number(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                every_figure_is_a_number(inner, f"{where}.{key}")
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                every_figure_is_a_number(inner, f"{where}[{index}]")
        else:
            assert isinstance(value, int | float) and not isinstance(value, bool), f"{where}: {value!r}"

    # The engine alone is the worker's own engine (the batcher here), at every concurrency of the fleet.
    assert [level["concurrency"] for level in data["engine_alone"]] == [1, 2]
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    assert data["engine_alone"][0]["itl_ms"]["n"] == sum(planned[:2]) - 2  # the engine's every token
    for run in [*data["engine_alone"], *data["levels"]]:
        wanted = planned[: run["requests"]]
        steady = {key: run.pop(key) for key in [key for key in run if key.startswith("steady_")]}
        every_figure_is_a_number(run, "run")
        # Beside tokens over the wall time: tokens a second while every stream was generating, in a window
        # inside the run counting some of its tokens; null only with the reason. One stream has one.
        assert set(steady) == {"steady_tokens_per_s", "steady_from_s", "steady_window_s", "steady_tokens",
                               "steady_reason"}  # fmt: skip
        if steady["steady_tokens_per_s"] is None:
            assert run["concurrency"] > 1 and steady["steady_reason"], steady
        else:
            assert steady["steady_reason"] is None and steady["steady_from_s"] >= 0
            assert 0.1 * run["wall_s"] - 0.002 <= steady["steady_window_s"]
            assert steady["steady_from_s"] + steady["steady_window_s"] <= run["wall_s"] + 0.002
            assert 0 < steady["steady_tokens"] <= run["output_tokens"]
            tokens, window = steady["steady_tokens"], steady["steady_window_s"]  # each rounded
            lowest, highest = (tokens - 0.5) / (window + 0.0005), (tokens + 0.5) / (window - 0.0005)
            assert lowest - 0.01 <= steady["steady_tokens_per_s"] <= highest + 0.01
        assert run["requests"] == 2 * run["concurrency"] and run["errors"] == 0 and run["tokens_per_s"] > 0
        assert_summary(run["ttft_ms"], run["requests"])
        assert_summary(run["itl_ms"])  # a gap between text chunks: one per token but those without text
        assert 0 < run["itl_ms"]["n"] <= sum(wanted) - run["requests"]
        # End of sequence ignored: every request generates exactly its max tokens, the same list everywhere.
        assert [r["tokens"] for r in run["per_request"]] == [r["max_tokens"] for r in run["per_request"]]
        assert [r["max_tokens"] for r in run["per_request"]] == wanted
        assert run["output_tokens"] == sum(wanted)
    interference = data["interference"]
    every_figure_is_a_number({k: v for k, v in interference.items() if k != "long_prompts_sized_by"}, "i")
    assert interference["long_prompts_sized_by"] == "tokenize"  # the fleet's POST /tokenize
    assert all(abs(tokens - 200) <= 10 for tokens in interference["long_prompt_tokens"])
    assert interference["long_tokens"] == [16, 16, 16] and interference["short_tokens"] == 16
    assert len(interference["long_ttft_ms"]) == 3 and interference["short_sent_at_ms"] >= 500
    goals = {goal["goal"]: goal for goal in data["goals"]}  # no 4 streams here: that goal is left out
    assert len(goals) == 5 and all(isinstance(goal["pass"], bool) for goal in goals.values())
    assert "interference: the short chat's first token within 3 s" in goals
    assert "2 streams: tokens/s >= 0.95x the engine alone's" in goals
    assert "engine alone" in done.stdout and "goals" in done.stdout and "short chat" in done.stdout
    assert "tok/s  steady tok/s" in done.stdout


def test_the_prefix_bench_measures_second_turns_and_a_shared_system_prompt(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "prefix.json"
    done = bench(
        "prefix", "--model", str(tiny_model), "--conversations", "2", "--document-tokens", "300",
        "--users", "3", "--system-tokens", "300", "--max-tokens", "4", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["bench"] == "prefix" and data["options"]["workers"] == 1
    conversations, system = data["conversations"], data["shared_system_prompt"]
    assert len(conversations["first_turns"]) == len(conversations["second_turns"]) == 2
    for first, second in zip(conversations["first_turns"], conversations["second_turns"], strict=True):
        assert 256 < first["prompt_tokens"] < 512 and first["cached_tokens"] == 0  # documents share nothing
        assert second["prompt_tokens"] > first["prompt_tokens"]
        assert second["cached_tokens"] == 256  # the first turn's whole prefill chunk (256 tokens)
        assert first["tokens"] == second["tokens"] == 4
    # The ratio is of the medians before they were rounded to 0.1 ms: within what that rounding allows.
    first_ms, second_ms = conversations["first_ttft_ms_median"], conversations["second_ttft_ms_median"]
    lowest, highest = (second_ms - 0.05) / (first_ms + 0.05), (second_ms + 0.05) / (first_ms - 0.05)
    assert lowest - 1e-4 <= conversations["second_over_first"] <= highest + 1e-4
    cached = [request["cached_tokens"] for request in system["requests"]]
    assert cached == [0, 256, 256]  # the system prompt's first chunk, from the second user on
    assert system["cached_tokens"] == 512 and system["prompt_tokens"] > 3 * 256
    assert system["saved"] == pytest.approx(512 / system["prompt_tokens"], abs=1e-3)
    assert [goal["pass"] for goal in data["goals"]] == [
        conversations["second_over_first"] <= 0.25,
        system["saved"] >= 0.8,
    ]
    assert "second turn" in done.stdout and "goals" in done.stdout


def test_the_structured_bench_counts_the_answers_that_come_back_whole_with_and_without_closing(
    tiny_model: Path, tmp_path: Path
) -> None:
    from ortfleet.bench.structured_cases import OBJECT_PROMPTS, PARSE_CASES, TOOL_ARGUMENTS, TOOL_CASES

    out = tmp_path / "structured.json"
    done = bench(
        "structured", "--model", str(tiny_model), "--parse-tokens", "60", "--object-tokens", "12", "30",
        "--tool-tokens", "70", "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["bench"] == "structured"
    assert data["options"] == {"parse_tokens": [60], "object_tokens": [12, 30], "tool_tokens": [70]}
    [parse], objects, [tools] = data["parse"], data["json_object"], data["tool_calls"]
    assert [r["schema"] for r in parse["requests"]] == [schema.__name__ for schema, _ in PARSE_CASES]
    for (schema, _), record in zip(PARSE_CASES, parse["requests"], strict=True):
        assert record["ok"] and record["finish_reason"] == "stop", record  # closed early where need be
        assert 0 < record["completion_tokens"] <= 60
        schema.model_validate_json(record["text"])
        if not record["without_closing"]["ended"]:  # max_tokens cut it: it was closed early
            assert record["closed_early"] and not record["without_closing"]["ok"]
    assert [run["max_tokens"] for run in objects] == [12, 30]
    for run in objects:
        assert [r["prompt"] for r in run["requests"]] == OBJECT_PROMPTS
        for record in run["requests"]:
            assert 0 < record["completion_tokens"] <= run["max_tokens"]
            assert record["ok"] and isinstance(json.loads(record["text"]), dict)
    assert [(r["tool"], r["prompt"]) for r in tools["requests"]] == TOOL_CASES * 2
    for record in tools["requests"]:  # the tools fill most of the tiny model's context of 512 tokens
        if record["ok"]:
            [[name, arguments]] = json.loads(record["text"])
            TOOL_ARGUMENTS[name].model_validate_json(arguments)
        else:
            assert record["miss"].startswith("400: ")  # no room for the call, or for the prompt
    assert tools["ok"] == sum(r["ok"] for r in tools["requests"])
    for run in (parse, *objects):
        assert run["ok"] == sum(r["ok"] for r in run["requests"]) == run["of"] == 10
        assert run["unchanged"] == run["ended_alone"]
    assert "goals" in done.stdout


def test_the_hog_bench_serves_another_keys_chats_while_one_key_holds_every_row(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hog.json"
    done = bench(
        "hog", "--model", str(tiny_model), "--rows", "2", "--long", "2", "--long-words", "40",
        "--choices", "2", "--long-max-tokens", "8", "--short", "2", "--max-tokens", "4", "--delay", "0.2",
        "--json", str(out),
    )  # fmt: skip

    data = figures(out)
    assert data["bench"] == "hog" and data["options"]["rows"] == 2 and data["options"]["choices"] == 2
    short, long = data["short"], data["long"]
    assert len(short["requests"]) == 2 and len(long["requests"]) == 2
    for request in short["requests"]:
        assert request["status"] == 200 and request["total_s"] >= (request["ttft_s"] or 0) >= 0
    assert short["answered_with_text"] == sum(1 for r in short["requests"] if r["text"])
    for request in long["requests"]:
        assert request["status"] == 200 and request["prompt_tokens"] > 40
        assert len(request["job_preemptions"]) == 2 and request["preemptions"] == sum(
            request["job_preemptions"]
        )
    assert long["succeeded"] == 2 and long["preemptions"] == sum(r["preemptions"] for r in long["requests"])
    assert long["most_preemptions_of_a_job"] == max(n for r in long["requests"] for n in r["job_preemptions"])
    ttft_goal = short["ttft_s"]["max"] is not None and short["ttft_s"]["max"] <= 3.0
    assert [goal["pass"] for goal in data["goals"]] == [short["answered_with_text"] == 2, True, ttft_goal]
    assert "goals" in done.stdout and "short" in done.stdout


def test_the_hostile_benchs_prefill_flood_runs_alone_then_beside_the_well_behaved_keys_chats(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "flood.json"
    args = ["--attack", "prefill-flood", "--duration", "3", "--alone", "2", "--flood-threads", "2"]
    done = bench("hostile", "--model", str(tiny_model), *args, "--good-tokens", "6", "--json", str(out))

    data = figures(out)
    assert data["bench"] == "hostile" and data["attack"] == "prefill-flood" and data["pattern"] is None
    good = data["well_behaved"]
    assert good["tokens"] == 6 and good["failures"] == {} and good["succeeded"] == good["requests"] > 0
    assert_summary(good["latency_ms"], good["succeeded"])
    assert_summary(good["ttft_ms"], good["succeeded"])
    assert set(good["gap_ms"]) == {"p50", "p95", "p99", "max", "mean", "n"}
    assert set(data["flood"]) == {"alone", "contended"} and data["refused_formats"] is None
    for flood in data["flood"].values():
        assert flood["requests"] > 0 and flood["completion_tokens"] <= flood["requests"]  # 1-token chats
        assert flood["prompt_tokens_mean"] > 50  # the note's 50 words at least, each prompt its own
        tokens = flood["prompt_tokens"] + flood["completion_tokens"]
        assert flood["tokens_per_s"] == pytest.approx(tokens / flood["wall_s"], rel=1e-3)  # wall_s rounded
    assert data["flood"]["alone"]["wall_s"] < data["flood"]["contended"]["wall_s"]
    assert "flooding key, alone" in done.stdout and "flooding key, contended" in done.stdout


def test_the_hostile_benchs_refused_formats_are_each_refused_as_max_tokens_too_small_at_the_rate_asked(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "refused.json"
    args = ["--attack", "refused-formats", "--pattern", "^[a]{300}$", "--rate", "6", "--rows", "2"]
    done = bench("hostile", "--model", str(tiny_model), *args, "--duration", "3", "--json", str(out))

    data = figures(out)
    assert data["attack"] == "refused-formats" and data["pattern"] == "^[a]{300}$" and data["flood"] is None
    good = data["well_behaved"]
    assert good["failures"] == {} and good["succeeded"] == good["requests"] > 0
    refused = data["refused_formats"]
    assert refused["target_rate_per_s"] == 6 and 2 <= refused["sent"] <= 6 * 3 + 2
    assert refused["outcomes"] == {"400 max_tokens_too_small": refused["sent"]}
    assert refused["refused_max_tokens_too_small"] == refused["sent"]
    assert_summary(refused["latency_ms"], refused["sent"])
    assert "refused max_tokens_too_small" in done.stdout
