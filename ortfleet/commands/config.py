"""`ortfleet config`: the effective settings of the gateway and a worker, secrets masked."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from common.gateway_settings import GatewaySettings
from common.settings import FleetSettings, effective_settings
from common.worker_settings import WorkerSettings
from ortfleet import configuration_page
from ortfleet.commands import Subparsers


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="show the effective settings of the gateway and the worker (secrets masked)",
        description="Show the settings the gateway and a worker would run with here: ORTFLEET_* environment "
        "variables, .env, then defaults. Passwords are masked.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="print the reference of every setting and flag as Markdown (docs/configuration.md) instead",
    )
    parser.set_defaults(func=show_config)


def show_config(args: argparse.Namespace) -> int:
    if args.reference:
        print(configuration_page.render(args.command_line), end="")
        return 0
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
