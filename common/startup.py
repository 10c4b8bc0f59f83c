"""Mistakes found while a process starts (a setting, a file, a port, Redis), reported as its last words:
one line each on stderr saying what is wrong and what to do, and exit status 1. At log level debug the
traceback comes first."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from collections.abc import Mapping
from typing import NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from common.settings import FleetSettings
from common.store_config import StoreConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = FleetSettings.model_config.get("env_prefix", "")
_UNPARSED_FIELD = re.compile(r'field "(\w+)"')
S = TypeVar("S", bound=BaseSettings)


class CannotStart(Exception):
    """The process cannot start as configured; the message, one line, names what is wrong and what to do."""


def settings_error_lines(
    error: ValidationError | SettingsError, flags: Mapping[str, str] | None = None
) -> list[str]:
    """One line per invalid setting: its environment variable (or the command-line flag it was given
    with, from `flags`: field -> flag) and pydantic's message. The values are left out: some are
    secrets."""
    flags = flags or {}

    def named(field: str) -> str:
        return flags.get(field) or f"{ENV_PREFIX}{field}".upper()

    if isinstance(error, SettingsError):  # a complex value (a JSON map) that did not parse
        match = _UNPARSED_FIELD.search(str(error))
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        return [f"{named(match.group(1))}: cannot be parsed{cause}" if match else str(error)]
    lines = []
    for problem in error.errors():
        field, *inner = (str(part) for part in problem["loc"])
        where = named(field) + "".join(f"[{part}]" for part in inner)
        lines.append(f"{where}: {problem['msg'].removeprefix('Value error, ')}")
    return lines


def settings_or_exit(
    prog: str, settings_class: type[S], args: argparse.Namespace, flags: Mapping[str, str]
) -> S:
    """The settings from the environment, with the command line's flags (`flags`: field -> flag) over
    them; an invalid one ends the process with a line naming each (by its flag where it came from one)."""
    given = {field: getattr(args, field) for field in flags if getattr(args, field) is not None}
    try:
        return settings_class(**given)
    except (ValidationError, SettingsError) as e:
        lines = settings_error_lines(e, {field: flags[field] for field in given})
        exit_with(prog, lines, e, debug=debug_wanted(None))


def log_to_stderr(settings: FleetSettings) -> None:
    """The process's log lines on stderr at its settings' level, each with its time, level and logger."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def debug_wanted(settings: FleetSettings | None) -> bool:
    """Whether the process runs at log level debug; before its settings are read, as the environment says."""
    if settings is not None:
        return settings.log_level == "debug"
    return os.environ.get(f"{ENV_PREFIX}LOG_LEVEL", "").strip().lower() == "debug"


def exit_with(prog: str, lines: list[str], error: BaseException, *, debug: bool) -> NoReturn:
    """Ends the process with `lines` on stderr, each prefixed with `prog`; with `debug`, the error's
    traceback before them."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    for line in lines:
        print(f"{prog}: {line}", file=sys.stderr)
    raise SystemExit(1)


def store_label(model: str, index: int, stores: int) -> str:
    """How messages name the store at `index` (0-based) of a model's `stores`: by its position, as
    ORTFLEET_STORE (--store) counts them."""
    return f"store {index + 1} of {stores} of model {model!r}"


def check_store_config(config: StoreConfig, label: str, allow_eviction: bool) -> None:
    """CannotStart for a Redis that evicts keys, unless `allow_eviction`; a warning for each other thing
    an operator should know (no persistence, a policy that could not be read)."""
    if config.evicts and not allow_eviction:
        raise CannotStart(config.eviction_refusal(label))
    for line in config.warnings(label, allow_eviction):
        logger.warning("%s", line)
