"""`ortfleet bench serving`, `prefix`, `structured` and `hog`: what a client of the server gets."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.commands.bench.arguments import (
    command_line,
    finish,
    int_list,
    lengths,
    model_dir,
    positive,
    server_url,
)

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def add_modes(modes: Subparsers) -> None:
    serving = modes.add_parser(
        "serving",
        help="what clients get: the engine alone, then ortfleet (or any OpenAI-compatible server) at "
        "several concurrencies, and a short chat during long prefills; goals checked",
        description="On one model folder and one fixed list of requests (mixed output lengths, end of "
        "sequence ignored), in one run: the engine a worker on --device runs, alone in this process, at "
        "each concurrency; then a local fleet (Redis, a gateway, one worker on the model) or "
        "the OpenAI-compatible server at --url (llama.cpp's llama-server, vLLM), streamed completions "
        "from closed-loop clients at each concurrency: tokens/s (over the wall time, and while every "
        "stream was generating), TTFT, ITL; then three long prompts at "
        "once and a short chat request 0.5 s later: its TTFT. Then the goals against this run's figures. "
        "With --models, the streams name a list of models in turn (a model and its LoRA adapters, --lora or "
        "--random-lora on the local fleet): each list at each concurrency, the figures by name too, and "
        "each list set against the first.",
    )
    serving.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model folder: the engine alone's and the local fleet's (default: the default model; with "
        "--url, no engine alone unless given)",
    )
    serving.add_argument(
        "--concurrency", type=int_list, default=[1, 4, 8], help="concurrent clients (default 1,4,8)"
    )
    serving.add_argument(
        "--requests", type=positive, default=16, help="requests per concurrency (default 16)"
    )
    serving.add_argument(
        "--lengths",
        type=lengths,
        default=(32, 224),
        metavar="MIN:MAX",
        help="output tokens of each request, drawn by a seeded random (default 32:224)",
    )
    serving.add_argument(
        "--long-prompt-tokens",
        type=positive,
        default=3000,
        help="prompt tokens of the interference run's long requests (default 3000)",
    )
    serving.add_argument("--no-interference", action="store_true", help="skip the prefill interference run")
    serving.add_argument(
        "--url", help="benchmark a running OpenAI-compatible server instead of starting a local fleet"
    )
    serving.add_argument("--name", help="served model name at --url (default: its only model)")
    serving.add_argument(
        "--device",
        default="auto",
        help="the engine alone's and the local fleet's worker's device: auto, cpu, cuda or cuda:N "
        "(default auto, as a worker picks)",
    )
    serving.add_argument(
        "--engine-concurrency",
        type=int_list,
        help="the engine alone's concurrencies (default: the same as --concurrency)",
    )
    serving.add_argument(
        "--gateways",
        type=positive,
        default=1,
        help="gateways of the local fleet, sharing one port (default 1)",
    )
    serving.add_argument(
        "--workers",
        type=positive,
        default=1,
        help="workers of the local fleet on the device; on a GPU each gets its share of the card's KV "
        "memory (default 1)",
    )
    serving.add_argument(
        "--shared-core",
        action="store_true",
        help="the local fleet's workers are the frontends of one engine core, which holds the model and "
        "its KV cache once and gives each worker its share of the rows",
    )
    serving.add_argument(
        "--client-processes",
        type=positive,
        default=1,
        help="processes the closed-loop clients run in (default 1; a GPU's rates want several)",
    )
    serving.add_argument(
        "--engine-only",
        action="store_true",
        help="measure the engine alone at --engine-concurrency (or --concurrency) and stop: no fleet, no "
        "interference run (a quick look at an engine setting such as ORTFLEET_CUDA_GRAPH)",
    )
    serving.add_argument(
        "--models",
        type=_mix,
        action="append",
        default=[],
        metavar="NAME,NAME,...",
        help="the model each stream names: stream i sends the i-th name (modulo the list's length), such as "
        "a model and its LoRA adapters; repeat to compare lists: each concurrency runs each list in turn, "
        "and the figures of the lists after the first are set against the first's (default: the served "
        "model alone; the local fleet serves its model as 'bench', its adapters under their names)",
    )
    serving.add_argument(
        "--rounds",
        type=positive,
        default=1,
        help="runs of each concurrency, every --models list once a round, in turns (default 1)",
    )
    serving.add_argument(
        "--lora",
        type=_adapter,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter the local fleet's workers serve beside the model under NAME (repeatable; "
        "the CPU batcher only)",
    )
    serving.add_argument(
        "--random-lora",
        type=positive,
        metavar="N",
        help="the local fleet's workers also serve N random LoRA adapters the bench writes for the model "
        "(rank 16 on every projection), named random-1 ... random-N",
    )
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
    prefix.add_argument("--workers", type=positive, default=1, help="workers of the local fleet (default 1)")
    prefix.add_argument("--conversations", type=positive, default=6, help="conversations (default 6)")
    prefix.add_argument(
        "--document-tokens", type=positive, default=1500, help="tokens of each document (default 1500)"
    )
    prefix.add_argument(
        "--users", type=positive, default=20, help="users after the system prompt (default 20)"
    )
    prefix.add_argument(
        "--system-tokens", type=positive, default=1000, help="tokens of the system prompt (default 1000)"
    )
    prefix.add_argument("--max-tokens", type=positive, default=32, help="tokens of each answer (default 32)")
    prefix.add_argument(
        "--url", help="benchmark a running OpenAI-compatible server instead of starting a local fleet"
    )
    prefix.add_argument("--name", help="served model name at --url (default: its only model)")
    prefix.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    prefix.set_defaults(func=run_prefix)

    structured = modes.add_parser(
        "structured",
        help="does constrained JSON come back whole within max_tokens: chat.completions.parse on ten "
        "schemas, json_object on ten prompts, named and required tool calls; goals checked",
        description="On a local fleet (Redis, a gateway, one worker on the model) or the OpenAI-compatible "
        "server at --url: ten small pydantic models through the openai SDK's chat.completions.parse, ten "
        "json_object requests and ten tool calls (five prompts, tool named and required), greedy, at each "
        "max_tokens given; each request also with close_early false. Counts the answers that parse (and "
        "validate), those closed early, and those the model ended on its own that closing left unchanged, "
        "with each answer's text and why a miss missed; then the goals.",
    )
    structured.add_argument(
        "--model", type=Path, metavar="DIR", help="model folder (default: the default model)"
    )
    structured.add_argument(
        "--parse-tokens",
        type=positive,
        nargs="+",
        default=[40, 60, 120],
        help="max_tokens of the parse requests, one run of ten each (default 40 60 120)",
    )
    structured.add_argument(
        "--object-tokens",
        type=positive,
        nargs="+",
        default=[20, 60],
        help="max_tokens of the json_object requests, one run of ten each (default 20 60)",
    )
    structured.add_argument(
        "--tool-tokens",
        type=positive,
        nargs="+",
        default=[24],
        help="max_tokens of the tool-call requests, one run of ten each (default 24)",
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
        "sends --long chats of about --long-words words at once, each with --choices choices (one job "
        "each); --delay seconds later another key streams --short chats one after another. Prints each "
        "short chat's status, text, TTFT and total time, and each long chat's prompt tokens, total time "
        "and its jobs' preemptions; then the goals.",
    )
    hog.add_argument("--model", type=Path, metavar="DIR", help="model folder (default: the default model)")
    hog.add_argument("--rows", type=positive, default=8, help="the worker's batch rows (default 8)")
    hog.add_argument("--long", type=positive, default=8, help="the hog key's long chats (default 8)")
    hog.add_argument(
        "--long-words", type=positive, default=5200, help="words of each long chat (default 5200)"
    )
    hog.add_argument("--choices", type=positive, default=1, help="n of each long chat: its jobs (default 1)")
    hog.add_argument("--short", type=positive, default=10, help="the other key's chats (default 10)")
    hog.add_argument("--max-tokens", type=positive, default=16, help="tokens of every answer (default 16)")
    hog.add_argument(
        "--long-max-tokens", type=positive, help="tokens of each long chat's answers (default: --max-tokens)"
    )
    hog.add_argument(
        "--delay", type=float, default=2.0, help="seconds between the long chats and the first short one"
    )
    hog.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    hog.set_defaults(func=run_hog)


def run_serving(args: argparse.Namespace) -> int:
    from ortfleet.bench import serving

    url = server_url(args, "serving")
    if args.engine_only and url is not None:
        raise SystemExit("ortfleet bench serving: --engine-only measures a local engine: drop --url")
    if url is not None and (args.lora or args.random_lora):
        raise SystemExit(
            "ortfleet bench serving: --lora and --random-lora are for the local fleet's workers; the server "
            "at --url serves its own adapters: name them with --models"
        )
    options = serving.ServingOptions(
        model_dir=None if args.url and args.model is None else model_dir(args.model),
        concurrency=args.concurrency,
        requests=args.requests,
        lengths=args.lengths,
        long_prompt_tokens=args.long_prompt_tokens,
        interference=not args.no_interference,
        url=url,
        name=args.name,
        command_line=command_line(),
        device=args.device,
        gateways=args.gateways,
        workers=args.workers,
        client_processes=args.client_processes,
        engine_concurrency=args.engine_concurrency,
        shared_core=args.shared_core,
        engine_only=args.engine_only,
        models=args.models,
        rounds=args.rounds,
        lora=dict(args.lora),
        random_lora=args.random_lora or 0,
    )
    figures = serving.run(options)
    return finish(figures, serving.text(figures), args.json)


def _mix(text: str) -> tuple[str, ...]:
    from ortfleet.bench.model_mix import parse_mix

    try:
        return parse_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _adapter(text: str) -> tuple[str, Path]:
    from ortfleet.bench.model_mix import parse_adapter

    try:
        return parse_adapter(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def run_prefix(args: argparse.Namespace) -> int:
    from ortfleet.bench import prefix

    url = server_url(args, "prefix")
    options = prefix.PrefixOptions(
        model_dir=None if args.url else model_dir(args.model),
        workers=args.workers,
        conversations=args.conversations,
        document_tokens=args.document_tokens,
        users=args.users,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
        url=url,
        name=args.name,
        command_line=command_line(),
    )
    figures = prefix.run(options)
    return finish(figures, prefix.text(figures), args.json)


def run_structured(args: argparse.Namespace) -> int:
    from ortfleet.bench import structured

    url = server_url(args, "structured")
    options = structured.StructuredOptions(
        model_dir=None if args.url else model_dir(args.model),
        parse_tokens=args.parse_tokens,
        object_tokens=args.object_tokens,
        tool_tokens=args.tool_tokens,
        url=url,
        name=args.name,
        api_key=args.api_key,
        command_line=command_line(),
    )
    figures = structured.run(options)
    return finish(figures, structured.text(figures), args.json)


def run_hog(args: argparse.Namespace) -> int:
    from ortfleet.bench import hog

    options = hog.HogOptions(
        model_dir=model_dir(args.model),
        rows=args.rows,
        long_requests=args.long,
        long_words=args.long_words,
        short_requests=args.short,
        max_tokens=args.max_tokens,
        choices=args.choices,
        long_max_tokens=args.long_max_tokens,
        delay_s=args.delay,
        command_line=command_line(),
    )
    figures = hog.run(options)
    return finish(figures, hog.text(figures), args.json)
