"""The Redis scripts ship as `.lua` files beside the modules that run them, loaded by common/lua.py."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from common import lua

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "gateway", "worker", "ortfleet")
_REGISTERED = re.compile(r"lua\.register\(\s*[\w.]+,\s*__name__,\s*\"(?P<name>[\w.-]+\.lua)\"")
_INCLUDED = re.compile(r"^-- include: (?P<name>[\w.-]+\.lua)", re.MULTILINE)


def _script_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.lua"))


def _package_of(path: Path) -> str:
    return ".".join(path.parent.parent.relative_to(ROOT).parts)


def _named_by_code() -> dict[Path, list[str]]:
    """Per Python module, the scripts it registers."""
    named: dict[Path, list[str]] = {}
    for package in PACKAGES:
        for module in (ROOT / package).rglob("*.py"):
            if module == ROOT / "common" / "lua.py":  # the loader, whose docstring shows a call
                continue
            names = [match["name"] for match in _REGISTERED.finditer(module.read_text())]
            if names:
                named[module] = names
    return named


@pytest.mark.unit
def test_every_lua_file_loads_with_its_includes_expanded() -> None:
    files = _script_files()
    assert files
    for path in files:
        assert path.parent.name == lua.FOLDER, path
        text = lua.package_source(_package_of(path), path.name)
        assert "-- include:" not in text, path
        assert text.strip(), path


@pytest.mark.unit
def test_an_include_brings_a_fragment_in_once() -> None:
    text = lua.package_source("common.jobs", "claim.lua")  # includes active.lua, and expire.lua does again
    assert text.count("local function leave_active(") == 1
    assert text.index("local function leave_active(") < text.index("local function expire_in_queue(")


@pytest.mark.unit
def test_every_script_the_code_names_exists_and_every_file_is_used() -> None:
    named = _named_by_code()
    used: set[Path] = set()
    for module, names in named.items():
        for name in names:
            path = module.parent / lua.FOLDER / name
            assert path.is_file(), (module, name)
            used.add(path)
    reading = list(used)
    while reading:
        path = reading.pop()
        for match in _INCLUDED.finditer(path.read_text()):
            included = path.parent / match["name"]
            assert included.is_file(), (path, included)
            if included not in used:
                used.add(included)
                reading.append(included)
    assert set(_script_files()) <= used, set(_script_files()) - used


@pytest.mark.unit
def test_no_lua_is_left_in_python_strings() -> None:
    for package in PACKAGES:
        for module in (ROOT / package).rglob("*.py"):
            assert "redis.call(" not in module.read_text(), module


@pytest.mark.unit
def test_the_package_data_ships_every_lua_file() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns: dict[str, list[str]] = config["package-data"]
    for path in _script_files():
        package = _package_of(path)
        relative = path.relative_to(ROOT / package.replace(".", "/")).as_posix()
        globs = patterns.get("*", []) + patterns.get(package, [])
        assert any(fnmatch.fnmatch(relative, glob) for glob in globs), path
