"""`ortfleet bench`: what the fleet costs on top of its engine, gateway capacity, pickup, balancing.

One module per family of modes; each adds its modes' parsers, in the order `--help` lists them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ortfleet.commands.bench import batching, capacity, fleet, hostile, scheduling, serving

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: fleet against direct engine (default), gateway capacity, pickup, simulation",
        description=f"Without a mode: {fleet.FLEET_HELP}. "
        "Modes: fleet (the same), gateway, redis, tokens, pickup, eta, sim, fairness, batching, serving, "
        "prefix, structured, hog, hostile.",
    )
    fleet.fleet_options(parser)
    parser.set_defaults(func=fleet.run_fleet)
    modes = parser.add_subparsers(title="modes", metavar="MODE")
    for family in (fleet, capacity, scheduling, batching, serving, hostile):
        family.add_modes(modes)
