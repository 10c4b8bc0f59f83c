"""`ortfleet keys create|list|revoke`: manage the API keys file the gateways read."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.apikeys import ApiKeyError, KeyFile
from common.gateway_settings import GatewaySettings

if TYPE_CHECKING:
    from ortfleet.commands import Subparsers


def register(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser("keys", help="create, list and revoke API keys")
    commands = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    create = commands.add_parser("create", help="create a key; it is printed once and stored only as a hash")
    create.add_argument("name", help="the key's name: it owns the jobs the key creates")
    create.add_argument("--max-concurrent-jobs", type=int, help="this key's own limit of active jobs")
    create.add_argument("--requests-per-minute", type=int, help="this key's own request rate limit")
    create.add_argument(
        "--weight", type=float, default=1.0, help="its share of tokens against other keys of a class (1)"
    )
    create.add_argument(
        "--max-class",
        choices=["interactive", "batch"],
        default="interactive",
        help="the highest priority class its jobs may take (interactive)",
    )
    create.set_defaults(func=_create)
    listing = commands.add_parser("list", help="list keys (names, hash prefixes, limits)")
    listing.set_defaults(func=_list)
    revoke = commands.add_parser("revoke", help="revoke a key; gateways notice within a second")
    revoke.add_argument("name")
    revoke.set_defaults(func=_revoke)
    for sub in (create, listing, revoke):
        sub.add_argument("--file", type=Path, help="keys file (default: ORTFLEET_API_KEYS_FILE)")


def _key_file(args: argparse.Namespace) -> KeyFile:
    path = args.file or GatewaySettings().api_keys_file
    if path is None:
        raise ApiKeyError("no keys file: pass --file PATH or set ORTFLEET_API_KEYS_FILE (gateways read it)")
    return KeyFile.load(path.expanduser())


def _run(args: argparse.Namespace, action: str) -> int:
    try:
        keys = _key_file(args)
        if action == "create":
            key = keys.create(
                args.name,
                max_concurrent_jobs=args.max_concurrent_jobs,
                requests_per_minute=args.requests_per_minute,
                weight=args.weight,
                max_class=args.max_class,
            )
            keys.save()
            print(f"created key {args.name!r} in {keys.path}; it is shown only now:", file=sys.stderr)
            print(key)
        elif action == "revoke":
            keys.revoke(args.name)
            keys.save()
            print(f"revoked key {args.name!r}", file=sys.stderr)
        else:
            header = f"{'NAME':24} {'SHA256':14} {'CREATED':20} {'MAX JOBS':>9} {'REQ/MIN':>8}"
            print(f"{header} {'WEIGHT':>6} MAX CLASS")
            for k in keys.keys:
                created = (
                    time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.created_at)) if k.created_at else "-"
                )
                print(
                    f"{k.name:24} {k.sha256[:12]}.. {created:20} "
                    f"{k.max_concurrent_jobs or '-':>9} {k.requests_per_minute or '-':>8} "
                    f"{k.weight:>6g} {k.max_class}"
                )
    except ApiKeyError as e:
        print(f"ortfleet keys: {e}", file=sys.stderr)
        return 1
    return 0


def _create(args: argparse.Namespace) -> int:
    return _run(args, "create")


def _list(args: argparse.Namespace) -> int:
    return _run(args, "list")


def _revoke(args: argparse.Namespace) -> int:
    return _run(args, "revoke")
