"""Prometheus file-based service discovery: a JSON file listing a fleet's /metrics targets."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def file_sd_groups(gateways: list[str], workers: list[str]) -> list[dict[str, Any]]:
    """Target groups (host:port each) labelled by role; Prometheus scrapes `/metrics` on each."""
    groups = [
        {"targets": gateways, "labels": {"role": "gateway"}},
        {"targets": workers, "labels": {"role": "worker"}},
    ]
    return [group for group in groups if group["targets"]]


def write_file_sd(path: Path, groups: list[dict[str, Any]]) -> None:
    """Replace the file in one step, so Prometheus, which watches it, never reads half of it."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        json.dump(groups, out, indent=2)
        out.write("\n")
    os.replace(partial, path)
