"""`ortfleet bench`: what the fleet costs on top of its engine, gateway capacity, pickup, balancing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ortfleet.bench.backends import FLEET_APIS

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers

FLEET_HELP = (
    "N concurrent streaming clients against the worker's engine in-process (direct) and against the "
    "whole fleet over HTTP/SSE, in one run, with the same prompts and a fixed generation length"
)


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: fleet against direct engine (default), gateway capacity, pickup, simulation",
        description=f"Without a mode: {FLEET_HELP}. "
        "Modes: fleet (the same), gateway, redis, pickup, eta, sim, fairness, batching, serving, prefix, "
        "structured, hog.",
    )
    _fleet_options(parser)
    parser.set_defaults(func=run_fleet)
    modes = parser.add_subparsers(title="modes", metavar="MODE")

    fleet = modes.add_parser("fleet", help=FLEET_HELP, description=FLEET_HELP)
    _fleet_options(fleet)
    fleet.set_defaults(func=run_fleet)

    gateway = modes.add_parser(
        "gateway",
        help="one gateway alone (no model): concurrent SSE streams, relay latency, submissions/s",
        description="Starts redis-server and one gateway. A synthetic publisher writes token entries to "
        "the streams of N open SSE connections at a set rate; the client measures publish -> receipt "
        "latency. Then submissions per second on POST /v1/jobs, and the gateway's memory per open stream.",
    )
    gateway.add_argument("--streams", type=_positive, default=5000, help="open SSE streams (default 5000)")
    gateway.add_argument(
        "--rate", type=float, default=1.0, help="token events per second on each stream (default 1)"
    )
    gateway.add_argument("--duration", type=float, default=20.0, help="seconds of publishing (default 20)")
    gateway.add_argument(
        "--submissions", type=_positive, default=5000, help="POST /v1/jobs requests (default 5000)"
    )
    gateway.add_argument(
        "--submit-concurrency", type=_positive, default=32, help="connections submitting (default 32)"
    )
    gateway.add_argument(
        "--writer",
        choices=["step", "plain"],
        default="step",
        help="how the synthetic publisher writes: step, as workers do (the step-write script, whose "
        "notice carries the entries; default), or plain (XADD and a notice of the stream keys alone, "
        "which the relay answers with reads)",
    )
    gateway.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    gateway.set_defaults(func=run_gateway)

    redis = modes.add_parser(
        "redis",
        help="what one Redis primary costs per submission and per token, and how many tokens/s it relays",
        description="Starts redis-server, a gateway and a fake-engine worker. Costs: jobs of 1 and of "
        "--max-tokens tokens, read over SSE; Redis commands (INFO commandstats) and CPU (INFO cpu) per "
        "submission and per generated token. Ceiling: a synthetic publisher writes token entries to "
        "--streams open SSE streams at each of --rates, until relay p99 passes --p99-target.",
    )
    redis.add_argument("--jobs", type=_positive, default=200, help="jobs per cost run (default 200)")
    redis.add_argument("--max-tokens", type=_positive, default=64, help="tokens per long job (default 64)")
    redis.add_argument("--streams", type=_positive, default=500, help="open SSE streams (default 500)")
    redis.add_argument(
        "--rates",
        type=_float_list,
        default=[1.0, 2.0, 5.0, 10.0, 20.0, 40.0],
        help="token events per second per stream, one step each (default 1,2,5,10,20,40)",
    )
    redis.add_argument("--step", type=float, default=10.0, help="seconds of publishing per step (default 10)")
    redis.add_argument(
        "--p99-target", type=float, default=50.0, help="relay p99 to stay under, ms (default 50)"
    )
    redis.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    redis.set_defaults(func=run_redis)

    pickup = modes.add_parser(
        "pickup",
        help="time from submission to an idle worker starting the job",
        description="Sequential 1-token jobs on an idle worker: submission -> start on the worker "
        "(the job's timings.queue_wait_s) and submission -> the client receiving the 'running' event.",
    )
    pickup.add_argument("--jobs", type=_positive, default=200, help="sequential jobs (default 200)")
    pickup.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    pickup.add_argument(
        "--fake-engine",
        metavar="DELAY_MS:CAPACITY",
        help="serve a fake engine instead of a model (e.g. 10:4)",
    )
    pickup.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    pickup.set_defaults(func=run_pickup)

    eta = modes.add_parser(
        "eta",
        help="how close a queued job's queue_eta_s comes to when it starts",
        description="A burst of jobs of mixed sizes (ignore_eos) on one worker: each job's queue_eta_s, read "
        "right after the burst, against the wait it had until it started.",
    )
    eta.add_argument("--jobs", type=_positive, default=40, help="jobs in the burst (default 40)")
    eta.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    eta.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    eta.set_defaults(func=run_eta)

    sim = modes.add_parser(
        "sim",
        help="a simulated multi-GPU fleet: fake engines of different speeds behind the real gateway",
        description="Starts workers with fake engines (a per-token delay and a capacity each) behind the "
        "real gateway, queue and worker code, keeps the queue busy with fixed-length jobs, and reports "
        "each worker's share of tokens against its share of speed x capacity, queue waits, and the "
        "time any worker sat idle while jobs waited.",
    )
    sim.add_argument(
        "--workers",
        default="40:2,40:4,20:2,20:4,13.3:2,13.3:4,10:2,10:4",
        help="DELAY_MS:CAPACITY of each worker, comma-separated (default: 8 workers, 1x to 4x speed)",
    )
    sim.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    sim.add_argument("--max-tokens", type=_positive, default=32, help="tokens per job (default 32)")
    sim.add_argument(
        "--clients",
        type=_positive,
        help="concurrent clients (default: 1.5x the fleet's total capacity, so jobs always wait)",
    )
    sim.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    sim.set_defaults(func=run_sim)

    fairness = modes.add_parser(
        "fairness",
        help="priority classes and fair share between keys, on fake engines behind the real fleet",
        description="Scenario A: one key floods batch jobs while another sends an interactive job every "
        "interval; its queue wait and TTFT against an idle fleet, and every finished flood job checked "
        "exact. Scenario B: two saturating keys, weights 1:1 then 3:1; their token shares.",
    )
    fairness.add_argument(
        "--workers",
        default="20:4,20:4",
        help="DELAY_MS:CAPACITY[:static] of each worker (default 20:4,20:4)",
    )
    fairness.add_argument("--duration", type=float, default=20.0, help="seconds of each phase (default 20)")
    fairness.add_argument("--flood-jobs", type=_positive, default=2000, help="batch jobs (default 2000)")
    fairness.add_argument("--flood-tokens", type=_positive, default=64, help="tokens per batch job (64)")
    fairness.add_argument(
        "--light-tokens", type=_positive, default=16, help="tokens per interactive job (16)"
    )
    fairness.add_argument(
        "--interval", type=float, default=0.5, help="seconds between interactive jobs (default 0.5)"
    )
    fairness.add_argument("--share-tokens", type=_positive, default=32, help="tokens per job in B (32)")
    fairness.add_argument(
        "--no-preempt", action="store_true", help="workers do not preempt batch work (ORTFLEET_PREEMPT_BATCH)"
    )
    fairness.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    fairness.set_defaults(func=run_fairness)

    batching = modes.add_parser(
        "batching",
        help="ways for a CPU worker to step different requests' rows together: greedy tokens checked, "
        "ms per decode step",
        description="On one model folder, in one run: onnxruntime's InferenceSession with KV buffers "
        "owned by ortfleet (past in and present out; the same through IOBinding; one buffer bound as both, "
        "ORT-GenAI's share-buffer mode), one og.Generator per request stepped in turn, and one og.Generator "
        "holding every row (og.Engine's static batch). Each candidate's greedy tokens for a few prompts "
        "(rows joining two steps apart) against each prompt's lone og.Generator, then ms per decode step "
        "at each batch size and past length, the candidates measured back to back.",
    )
    batching.add_argument(
        "--model", type=Path, metavar="DIR", help="model folder (default: the default model)"
    )
    batching.add_argument(
        "--batch-sizes", type=_int_list, default=[1, 2, 4, 8], help="rows per step (default 1,2,4,8)"
    )
    batching.add_argument(
        "--past-lengths",
        type=_int_list,
        default=[100, 1000],
        help="tokens already in the longest row's KV (the other rows up to a third fewer; default 100,1000)",
    )
    batching.add_argument("--steps", type=_positive, default=32, help="timed decode steps per figure (32)")
    batching.add_argument(
        "--tokens", type=_positive, default=24, help="greedy tokens per prompt in the correctness check (24)"
    )
    batching.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    batching.set_defaults(func=run_batching)

    serving = modes.add_parser(
        "serving",
        help="what clients get: the engine alone, then ortfleet (or any OpenAI-compatible server) at "
        "several concurrencies, and a short chat during long prefills; goals checked",
        description="On one model folder and one fixed list of requests (mixed output lengths, end of "
        "sequence ignored), in one run: one og.Generator per request in this process, requests one after "
        "another (the engine alone); then a local fleet (Redis, a gateway, one worker on the model) or "
        "the OpenAI-compatible server at --url (llama.cpp's llama-server, vLLM), streamed completions "
        "from closed-loop clients at each concurrency: tokens/s, TTFT, ITL; then three long prompts at "
        "once and a short chat request 0.5 s later: its TTFT. Then the goals against this run's figures.",
    )
    serving.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model folder: the engine alone's and the local fleet's (default: the default model; with "
        "--url, no engine alone unless given)",
    )
    serving.add_argument(
        "--concurrency", type=_int_list, default=[1, 4, 8], help="concurrent clients (default 1,4,8)"
    )
    serving.add_argument(
        "--requests", type=_positive, default=16, help="requests per concurrency (default 16)"
    )
    serving.add_argument(
        "--lengths",
        type=_lengths,
        default=(32, 224),
        metavar="MIN:MAX",
        help="output tokens of each request, drawn by a seeded random (default 32:224)",
    )
    serving.add_argument(
        "--long-prompt-tokens",
        type=_positive,
        default=3000,
        help="prompt tokens of the interference run's long requests (default 3000)",
    )
    serving.add_argument("--no-interference", action="store_true", help="skip the prefill interference run")
    serving.add_argument(
        "--url", help="benchmark a running OpenAI-compatible server instead of starting a local fleet"
    )
    serving.add_argument("--name", help="served model name at --url (default: its only model)")
    serving.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    serving.set_defaults(func=run_serving)

    prefix = modes.add_parser(
        "prefix",
        help="what prefix reuse saves: second turns of long conversations, and many users after one "
        "system prompt; goals checked",
        description="On a local fleet (Redis, a gateway, --workers workers on the model) or the "
        "OpenAI-compatible server at --url, in one run: the first turns of several conversations about "
        "long documents of their own, one after another, then their second turns: the median TTFT of each; "
        "then many users' questions after one long system prompt: the share of their prompt tokens the "
        "server reused (usage.prompt_tokens_details.cached_tokens). Then the goals against this run's "
        "figures.",
    )
    prefix.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    prefix.add_argument("--workers", type=_positive, default=1, help="workers of the local fleet (default 1)")
    prefix.add_argument("--conversations", type=_positive, default=6, help="conversations (default 6)")
    prefix.add_argument(
        "--document-tokens", type=_positive, default=1500, help="tokens of each document (default 1500)"
    )
    prefix.add_argument(
        "--users", type=_positive, default=20, help="users after the system prompt (default 20)"
    )
    prefix.add_argument(
        "--system-tokens", type=_positive, default=1000, help="tokens of the system prompt (default 1000)"
    )
    prefix.add_argument("--max-tokens", type=_positive, default=32, help="tokens of each answer (default 32)")
    prefix.add_argument(
        "--url", help="benchmark a running OpenAI-compatible server instead of starting a local fleet"
    )
    prefix.add_argument("--name", help="served model name at --url (default: its only model)")
    prefix.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    prefix.set_defaults(func=run_prefix)

    structured = modes.add_parser(
        "structured",
        help="does constrained JSON come back whole: chat.completions.parse on ten schemas, json_object on "
        "ten prompts; goals checked",
        description="On a local fleet (Redis, a gateway, one worker on the model) or the OpenAI-compatible "
        "server at --url: ten small pydantic models through the openai SDK's chat.completions.parse, greedy, "
        "and ten json_object requests. Counts the answers that parse (ended on their own and validate), "
        "with each answer's text and why a miss missed; then the goals.",
    )
    structured.add_argument(
        "--model", type=Path, metavar="DIR", help="model folder (default: the default model)"
    )
    structured.add_argument(
        "--parse-tokens", type=_positive, default=120, help="max_tokens of each parse request (default 120)"
    )
    structured.add_argument(
        "--object-tokens",
        type=_positive,
        default=60,
        help="max_tokens of each json_object request (default 60)",
    )
    structured.add_argument(
        "--url", help="benchmark a running OpenAI-compatible server instead of starting a local fleet"
    )
    structured.add_argument("--name", help="served model name at --url (default: its only model)")
    structured.add_argument("--api-key", help="API key for --url (default: none)")
    structured.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    structured.set_defaults(func=run_structured)

    hog = modes.add_parser(
        "hog",
        help="one key's long prompts hold every row of a worker: are another key's chats served, how soon",
        description="On a local fleet with API keys (Redis, a gateway, one worker of --rows rows): one key "
        "sends --long chats of about --long-words words at once; --delay seconds later another key streams "
        "--short chats one after another. Prints each short chat's status, text, TTFT and total time, and "
        "each long chat's prompt tokens, total time and preemptions; then the goals.",
    )
    hog.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    hog.add_argument("--rows", type=_positive, default=8, help="the worker's batch rows (default 8)")
    hog.add_argument("--long", type=_positive, default=8, help="the hog key's long chats (default 8)")
    hog.add_argument(
        "--long-words", type=_positive, default=5200, help="words of each long chat (default 5200)"
    )
    hog.add_argument("--short", type=_positive, default=10, help="the other key's chats (default 10)")
    hog.add_argument("--max-tokens", type=_positive, default=16, help="tokens of every answer (default 16)")
    hog.add_argument(
        "--delay", type=float, default=2.0, help="seconds between the long chats and the first short one"
    )
    hog.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    hog.set_defaults(func=run_hog)


def _fleet_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 2, 4, 8, 16],
        help="concurrent streams to measure, comma-separated (default 1,2,4,8,16)",
    )
    parser.add_argument(
        "--requests",
        type=_positive,
        help="requests per concurrency, per side and round (default 4x the concurrency, at least 8)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_positive,
        default=64,
        help="tokens every request generates (min = max, end of sequence masked; default 64)",
    )
    parser.add_argument("--rounds", type=_positive, default=1, help="repeat direct/fleet rounds (default 1)")
    parser.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    parser.add_argument("--url", help="benchmark a running gateway instead of starting a local fleet")
    parser.add_argument("--name", help="served model name at --url (default: its only model)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write a PNG: tokens/s and TTFT")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the engine's threads (the worker's and the direct run's) to cores of their own and "
        "the gateway, Redis, the worker's event loop and the client to the others (Linux)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_positive,
        metavar="N",
        help="the local fleet's worker streams a job's tokens N at a time (ORTFLEET_STREAM_INTERVAL; "
        "default: the environment's, else 1)",
    )
    parser.add_argument(
        "--api",
        choices=list(FLEET_APIS),
        default="jobs",
        help="how the fleet's clients ask: jobs (POST /v1/jobs, then its SSE stream), completions "
        "(POST /v1/completions with stream=true, OpenAI's chunks; the same prompts) or responses "
        "(POST /v1/responses with stream=true, greedy; the prompt as a chat message, which may end before "
        "--max-tokens, so not the direct run's work); default jobs",
    )
    parser.add_argument(
        "--engine-cores",
        type=_positive,
        metavar="N",
        help="with --pin: cores for the engine, the last N this process may use (default: half)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 1,2,4,8")
    return values


def _lengths(text: str) -> tuple[int, int]:
    from ortfleet.bench.serving import parse_lengths

    try:
        return parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from e
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 1,5,10")
    return values


def model_dir(given: Path | None) -> Path:
    if given is not None:
        path = given.expanduser().resolve()
        if not (path / "genai_config.json").is_file():
            raise SystemExit(
                f"ortfleet bench: {path} is not an ORT-GenAI model folder (no genai_config.json)"
            )
        return path
    from common.model_folder import default_model_dir, is_complete
    from common.settings import FleetSettings

    path = default_model_dir(FleetSettings().model_cache)
    if not is_complete(path):
        raise SystemExit(
            f"ortfleet bench: the default model is not built in {path}: run `ortfleet model default` "
            "or pass --model DIR"
        )
    return path


def _finish(figures: dict[str, Any], text: str, json_path: Path | None) -> int:
    from ortfleet.bench.report import write_json

    print(text)
    if json_path is not None:
        write_json(json_path, figures)
        print(f"figures written to {json_path}", file=sys.stderr)
    return 0


def run_fairness(args: argparse.Namespace) -> int:
    from ortfleet.bench import fairness

    options = fairness.FairnessOptions(
        workers=[part.strip() for part in args.workers.split(",") if part.strip()],
        duration_s=args.duration,
        flood_jobs=args.flood_jobs,
        flood_tokens=args.flood_tokens,
        light_tokens=args.light_tokens,
        interval_s=args.interval,
        share_tokens=args.share_tokens,
        preempt=not args.no_preempt,
    )
    figures = fairness.run(options)
    return _finish(figures, fairness.text(figures), args.json)


def run_batching(args: argparse.Namespace) -> int:
    from ortfleet.bench import batching

    options = batching.BatchingOptions(
        model_dir=model_dir(args.model),
        batch_sizes=args.batch_sizes,
        past_lengths=args.past_lengths,
        steps=args.steps,
        tokens=args.tokens,
    )
    figures = batching.run(options)
    return _finish(figures, batching.text(figures), args.json)


def run_fleet(args: argparse.Namespace) -> int:
    from common.worker_settings import WorkerSettings
    from ortfleet.bench import overhead, report
    from ortfleet.bench.pinning import Pinning

    pinning = None
    if args.pin:
        if args.url:
            raise SystemExit("ortfleet bench: --pin pins a local fleet's processes; it cannot with --url")
        try:
            pinning = Pinning.split(args.engine_cores)
        except ValueError as e:
            raise SystemExit(f"ortfleet bench: {e}") from e
    elif args.engine_cores is not None:
        raise SystemExit("ortfleet bench: --engine-cores goes with --pin")
    stream_interval = args.stream_interval
    if args.url:
        if stream_interval is not None:
            raise SystemExit(
                "ortfleet bench: --stream-interval sets a local fleet's worker; a fleet at --url has its own"
            )
    elif stream_interval is None:  # the local worker's own, from the environment
        stream_interval = WorkerSettings().stream_interval
    options = overhead.OverheadOptions(
        model_dir=model_dir(args.model),
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        url=args.url,
        name=args.name,
        pinning=pinning,
        stream_interval=stream_interval,
        api=args.api,
    )
    figures = overhead.run(options)
    if args.plot is not None:
        report.plot_fleet(figures, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return _finish(figures, report.fleet_table(figures), args.json)


def run_gateway(args: argparse.Namespace) -> int:
    from ortfleet.bench import capacity

    figures = capacity.run(
        capacity.CapacityOptions(
            streams=args.streams,
            rate=args.rate,
            duration_s=args.duration,
            submissions=args.submissions,
            submit_concurrency=args.submit_concurrency,
            writer=args.writer,
        )
    )
    return _finish(figures, capacity.text(figures), args.json)


def run_redis(args: argparse.Namespace) -> int:
    from ortfleet.bench import redis_load

    options = redis_load.RedisLoadOptions(
        jobs=args.jobs,
        max_tokens=args.max_tokens,
        streams=args.streams,
        rates=args.rates,
        step_s=args.step,
        p99_target_ms=args.p99_target,
    )
    figures = redis_load.run(options)
    return _finish(figures, redis_load.text(figures), args.json)


def run_pickup(args: argparse.Namespace) -> int:
    from ortfleet.bench import pickup

    model = None if args.fake_engine else model_dir(args.model)
    figures = pickup.run(model, args.fake_engine, args.jobs)
    return _finish(figures, pickup.text(figures), args.json)


def run_eta(args: argparse.Namespace) -> int:
    from ortfleet.bench import eta

    figures = eta.run(model_dir(args.model), args.jobs)
    return _finish(figures, eta.text(figures), args.json)


def run_sim(args: argparse.Namespace) -> int:
    from ortfleet.bench import sim

    try:
        workers = sim.parse_workers(args.workers)
    except ValueError as e:
        raise SystemExit(f"ortfleet bench sim: {e}") from e
    figures = sim.run(sim.SimOptions(workers, args.duration, args.max_tokens, args.clients))
    return _finish(figures, sim.text(figures), args.json)


def run_prefix(args: argparse.Namespace) -> int:
    import shlex

    from ortfleet.bench import prefix

    if args.name and not args.url:
        raise SystemExit("ortfleet bench prefix: --name names a model at --url")
    options = prefix.PrefixOptions(
        model_dir=None if args.url else model_dir(args.model),
        workers=args.workers,
        conversations=args.conversations,
        document_tokens=args.document_tokens,
        users=args.users,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
        url=args.url.rstrip("/") if args.url else None,
        name=args.name,
        command_line=shlex.join(["ortfleet", *sys.argv[1:]]),
    )
    figures = prefix.run(options)
    return _finish(figures, prefix.text(figures), args.json)


def run_structured(args: argparse.Namespace) -> int:
    import shlex

    from ortfleet.bench import structured

    if args.name and not args.url:
        raise SystemExit("ortfleet bench structured: --name names a model at --url")
    options = structured.StructuredOptions(
        model_dir=None if args.url else model_dir(args.model),
        parse_tokens=args.parse_tokens,
        object_tokens=args.object_tokens,
        url=args.url.rstrip("/") if args.url else None,
        name=args.name,
        api_key=args.api_key,
        command_line=shlex.join(["ortfleet", *sys.argv[1:]]),
    )
    figures = structured.run(options)
    return _finish(figures, structured.text(figures), args.json)


def run_hog(args: argparse.Namespace) -> int:
    import shlex

    from ortfleet.bench import hog

    options = hog.HogOptions(
        model_dir=model_dir(args.model),
        rows=args.rows,
        long_requests=args.long,
        long_words=args.long_words,
        short_requests=args.short,
        max_tokens=args.max_tokens,
        delay_s=args.delay,
        command_line=shlex.join(["ortfleet", *sys.argv[1:]]),
    )
    figures = hog.run(options)
    return _finish(figures, hog.text(figures), args.json)


def run_serving(args: argparse.Namespace) -> int:
    import shlex

    from ortfleet.bench import serving

    if args.name and not args.url:
        raise SystemExit("ortfleet bench serving: --name names a model at --url")
    options = serving.ServingOptions(
        model_dir=None if args.url and args.model is None else model_dir(args.model),
        concurrency=args.concurrency,
        requests=args.requests,
        lengths=args.lengths,
        long_prompt_tokens=args.long_prompt_tokens,
        interference=not args.no_interference,
        url=args.url.rstrip("/") if args.url else None,
        name=args.name,
        command_line=shlex.join(["ortfleet", *sys.argv[1:]]),
    )
    figures = serving.run(options)
    return _finish(figures, serving.text(figures), args.json)
