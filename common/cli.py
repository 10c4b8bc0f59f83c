"""`ortfleet`: the umbrella command of a fleet (config, up, model, ...)."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from common import fleet_up
from common.settings import FleetSettings, GatewaySettings, WorkerSettings, effective_settings

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

Handler: TypeAlias = Callable[[argparse.Namespace], int | None]

# Commands in modules of their own (e.g. `bench`, `status`), registered once the module exists:
# each has `register(subparsers)`, which adds its parser with `set_defaults(func=handler)`, where
# the handler takes the parsed arguments and returns the exit code.
PLUGGABLE_COMMANDS = (
    "common.fleet_bench",
    "common.fleet_status",
    "common.fault_drill",
    "common.keys_command",
)
MODEL_COMMAND = "common.modelbuild.command"


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
    code = handler(args)
    if code:
        raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ortfleet",
        description="Serve ONNX Runtime GenAI models through one HTTP endpoint backed by a pool of workers.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    register_config(subparsers)
    fleet_up.register(subparsers)
    model = _optional_module(MODEL_COMMAND)
    if model is not None:
        model.register(subparsers, cache_root_default=lambda: FleetSettings().model_cache)
    for name in PLUGGABLE_COMMANDS:
        module = _optional_module(name)
        if module is not None:
            module.register(subparsers)
    return parser


def _optional_module(name: str) -> Any:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        logger.debug("%s is not there: its command is left out", name)
        return None
    return importlib.import_module(name)


def _version() -> str:
    try:
        return importlib.metadata.version("ortfleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def register_config(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show the effective settings of the gateway and the worker (secrets masked)",
        description="Show the settings the gateway and a worker would run with here: ORTFLEET_* environment "
        "variables, .env, then defaults. Passwords are masked.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=show_config)


def show_config(args: argparse.Namespace) -> int:
    try:
        gateway, worker = GatewaySettings(), WorkerSettings()
    except ValidationError as e:
        print(f"ortfleet config: invalid settings:\n{e}", file=sys.stderr)
        return 2
    if args.json:
        shown = {"gateway": effective_settings(gateway), "worker": effective_settings(worker)}
        print(json.dumps(shown, indent=2, default=str))
    else:
        print(settings_table(gateway, worker))
    return 0


def settings_table(gateway: GatewaySettings, worker: WorkerSettings) -> str:
    shared = list(FleetSettings.model_fields)
    groups = {
        "shared (gateway and worker)": (gateway, shared),
        "gateway": (gateway, [f for f in GatewaySettings.model_fields if f not in shared]),
        "worker": (worker, [f for f in WorkerSettings.model_fields if f not in shared]),
    }
    rows: list[tuple[str, str, str] | str] = []
    for title, (settings, fields) in groups.items():
        values = effective_settings(settings)
        rows.append(title)
        rows += [(field, _env_name(settings, field), _show(values[field])) for field in fields]
    widths = [max(len(row[i]) for row in rows if isinstance(row, tuple)) for i in range(2)]
    lines: list[str] = []
    for row in rows:
        if isinstance(row, str):
            lines.append(("\n" if lines else "") + row)
        else:
            lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}")
    return "\n".join(lines)


def _env_name(settings: BaseSettings, field: str) -> str:
    return f"{settings.model_config.get('env_prefix', '')}{field}".upper()


def _show(value: Any) -> str:
    return "(not set)" if value is None else str(value)


if __name__ == "__main__":
    main()
