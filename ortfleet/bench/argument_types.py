"""Types of the benches' numeric options, shared by `ortfleet bench` and the benches' own `python -m`
entry points."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value
