"""What the modes of `ortfleet bench` share: argument types, the model folder, the figures' output."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ortfleet.bench.argument_types import positive as positive  # re-exported: the modes take it from here


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 1,2,4,8")
    return values


def lengths(text: str) -> tuple[int, int]:
    from ortfleet.bench.serving import parse_lengths

    try:
        return parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def float_list(text: str) -> list[float]:
    values = _numbers(text)
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 1,5,10")
    return values


def non_negative_list(text: str) -> list[float]:
    values = _numbers(text)
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of 0 or more, e.g. 0,20")
    return values


def _numbers(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from e


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


def finish(figures: dict[str, Any], text: str, json_path: Path | None) -> int:
    from ortfleet.bench.report import write_json

    print(text)
    if json_path is not None:
        write_json(json_path, figures)
        print(f"figures written to {json_path}", file=sys.stderr)
    return 0


def command_line() -> str:
    """The command as it was typed, for the figures."""
    return shlex.join(["ortfleet", *sys.argv[1:]])


def server_url(args: argparse.Namespace, mode: str) -> str | None:
    """The server at --url (None: a local fleet), its root; --name needs one."""
    if args.name and not args.url:
        raise SystemExit(f"ortfleet bench {mode}: --name names a model at --url")
    return server_root(args.url) if args.url else None


def server_root(url: str) -> str:
    """A server's root from its URL given either way: `http://host:8081` or, as OpenAI clients take it,
    `http://host:8081/v1` (the benches' paths start at /v1 themselves; /tokenize is at the root)."""
    return url.rstrip("/").removesuffix("/v1")
