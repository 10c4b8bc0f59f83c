"""Every third-party module the code imports comes from a distribution that pyproject.toml declares: a
fresh install never works only because some other package happened to pull the module in."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Mapping
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("ortfleet", "gateway", "worker", "common")
FIRST_PARTY = {*PRODUCT, "tests"}
# Extras an operator installs for a command of `ortfleet` that needs them (imported inside the function
# that needs them, never at a module's top, so that the rest runs without them).
OPERATOR_EXTRAS = ("model", "bench", "cuda")

pytestmark = pytest.mark.unit


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """Distribution names by extra ("" for the main dependencies)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {
        extra: {_normal(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]) for requirement in requirements}
        for extra, requirements in groups.items()
    }


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at the module's top) for each absolute import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], id(node) in top_level) for name in names]
    return [(module, at_top) for module, at_top in found if module not in sys.stdlib_module_names]


@functools.cache
def _distributions(module: str) -> set[str]:
    return {_normal(name) for name in _modules_to_distributions().get(module, [])}


@functools.cache
def _modules_to_distributions() -> Mapping[str, list[str]]:
    return packages_distributions()


def test_the_product_imports_only_what_it_declares() -> None:
    declared = _declared()
    operator = set().union(*(declared.get(extra, set()) for extra in OPERATOR_EXTRAS))
    problems = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, at_top in _imports(path):
                if module in FIRST_PARTY:
                    continue
                distributions = _distributions(module)
                where = path.relative_to(ROOT)
                if distributions & declared[""]:
                    continue
                if distributions & operator and not at_top:
                    continue
                if distributions & operator:
                    problems.append(f"{where}: {module} comes from an extra but is imported at the top")
                else:
                    problems.append(
                        f"{where}: {module} ({', '.join(sorted(distributions)) or '?'}) undeclared"
                    )
    assert not problems, "\n".join(problems)


def test_the_tests_import_only_what_the_environment_declares() -> None:
    everything = set().union(*_declared().values())
    problems = sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "tests").rglob("*.py")
        for module, _ in _imports(path)
        if module not in FIRST_PARTY and not _distributions(module) & everything
    )
    assert not problems, "\n".join(problems)


def test_every_extra_named_in_the_check_exists() -> None:
    assert set(OPERATOR_EXTRAS) <= _declared().keys()
