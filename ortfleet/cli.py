"""`ortfleet`: the umbrella command of a fleet (config, up, status, keys, model, bench, drill)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TypeAlias

from common.settings import FleetSettings
from ortfleet.commands import bench, config, drill, keys, model, status, up

Handler: TypeAlias = Callable[[argparse.Namespace], int | None]


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `ortfleet` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    handler: Handler | None = getattr(args, "func", None)
    if handler is None:
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    # Terminated, a command unwinds as on Ctrl-C: a fleet it started (a bench's, a drill's) stops with
    # it instead of running on without its parent. `ortfleet up` installs its own handlers.
    signal.signal(signal.SIGTERM, _interrupted)
    code = handler(args)
    if code:
        raise SystemExit(code)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ortfleet",
        description="Serve ONNX Runtime GenAI models through one HTTP endpoint backed by a pool of workers.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.set_defaults(command_line=parser)  # for `ortfleet config --reference`, which describes it
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    config.register(subparsers)
    up.register(subparsers)
    model.register(subparsers, cache_root_default=lambda: FleetSettings().model_cache)
    for command in (bench, status, drill, keys):
        command.register(subparsers)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("ortfleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    main()
