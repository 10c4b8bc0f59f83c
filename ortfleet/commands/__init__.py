"""One module per `ortfleet` command (`bench`: a package, one module per family of its modes). Each has
`register(subparsers)`, which adds its parser with `set_defaults(func=handler)`; the handler takes the
parsed arguments and returns the exit code."""

from __future__ import annotations

import argparse
from typing import TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
