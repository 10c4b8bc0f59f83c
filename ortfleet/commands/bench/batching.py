"""`ortfleet bench batching`: ways for a CPU worker to step different requests' rows together."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ortfleet.commands.bench.arguments import finish, int_list, model_dir, positive

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def add_modes(modes: Subparsers) -> None:
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
        "--batch-sizes", type=int_list, default=[1, 2, 4, 8], help="rows per step (default 1,2,4,8)"
    )
    batching.add_argument(
        "--past-lengths",
        type=int_list,
        default=[100, 1000],
        help="tokens already in the longest row's KV (the other rows up to a third fewer; default 100,1000)",
    )
    batching.add_argument("--steps", type=positive, default=32, help="timed decode steps per figure (32)")
    batching.add_argument(
        "--tokens", type=positive, default=24, help="greedy tokens per prompt in the correctness check (24)"
    )
    batching.add_argument("--json", type=Path, metavar="FILE", help="write every figure to FILE")
    batching.set_defaults(func=run_batching)


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
    return finish(figures, batching.text(figures), args.json)
