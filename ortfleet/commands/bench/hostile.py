"""`ortfleet bench hostile`: a well-behaved key's chats while another key attacks the fleet."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ortfleet.bench import hostile
from ortfleet.commands.bench.arguments import command_line, finish, model_dir

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def add_modes(modes: Subparsers) -> None:
    parser = modes.add_parser(
        "hostile",
        help="one key attacks (connections, costly or refused formats, a prefill flood): another key's "
        "success rate, latency and gap between tokens",
        description="On a local fleet with two API keys (Redis, a gateway, one worker on the model), the "
        "well-behaved key streams greedy chats of exactly --good-tokens tokens one after another for "
        "--duration seconds while the other key attacks: connections (slowloris, huge heads and bodies, a "
        "flood of event streams), formats (--rows chats whose --pattern costs most to close), prefill-flood "
        "(--flood-threads clients of 1-token chats of about 90 prompt tokens, first --alone seconds alone), "
        "refused-formats (--rows clients sending --rate requests a second of a --pattern format refused "
        "with 400 max_tokens_too_small), all of them at once, or none. Prints the well-behaved key's success "
        "rate, latency and gap between tokens, the flood's requests and tokens a second, the refusals.",
    )
    hostile.add_arguments(parser, "model folder (default: the default model)")
    parser.set_defaults(func=run_hostile)


def run_hostile(args: argparse.Namespace) -> int:
    figures = hostile.run(args.duration, model_dir(args.model), hostile.plan_of(args), command_line())
    return finish(figures, hostile.text(figures), args.json)
