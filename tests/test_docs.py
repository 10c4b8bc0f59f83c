"""The README and the reference pages in docs/ stay true to the code: generated where they can be, checked
where they are written by hand."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from starlette.routing import Mount, Route

from common.error_codes import ErrorCode
from common.gateway_settings import GatewaySettings
from common.worker_settings import WorkerSettings
from gateway.app import build_app
from gateway.metrics import GatewayMetrics
from ortfleet import configuration_page
from ortfleet.cli import build_parser
from worker.engines.batcher.counters import BatcherCounters
from worker.metrics import WorkerMetrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")])
CODE = [ROOT / folder for folder in ("common", "gateway", "worker", "ortfleet", "scripts", "deploy", "tests")]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_configuration_page_is_generated_from_the_current_settings_and_command_lines() -> None:
    page = configuration_page.render(build_parser())
    assert _text(DOCS / "configuration.md") == page, (
        f"docs/configuration.md is stale: run `.venv/bin/{configuration_page.GENERATED_BY}`"
    )


def test_every_setting_is_on_the_configuration_page() -> None:
    page = _text(DOCS / "configuration.md")
    for settings in (GatewaySettings, WorkerSettings):
        for name in settings.model_fields:
            assert f"`ORTFLEET_{name.upper()}`" in page


def test_every_ortfleet_variable_the_code_reads_is_on_the_configuration_page() -> None:
    page = _text(DOCS / "configuration.md")
    read = {
        name
        for folder in CODE
        for path in folder.rglob("*")
        if path.is_file() and path.suffix in {"", ".py", ".sh", ".yaml", ".yml", ".env"}
        for name in re.findall(r"ORTFLEET_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore"))
    }
    assert read, "the scan found no variable at all"
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"read by the code but not on docs/configuration.md: {missing}"


def test_every_route_is_on_the_api_page() -> None:
    page = _text(DOCS / "api.md")
    app = build_app(GatewaySettings(), GatewayMetrics())
    routes: list[str] = []
    for route in app.routes:
        if isinstance(route, Route):
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model_id:path} is {model_id}
            routes += [f"`{method} {path}`" for method in sorted(route.methods or ()) if method != "HEAD"]
        elif isinstance(route, Mount):
            routes.append(f"`GET {route.path}/`")
    assert routes
    missing = [route for route in routes if route not in page]
    assert not missing, f"served but not on docs/api.md: {missing}"


def test_every_error_code_is_on_the_api_page() -> None:
    page = _text(DOCS / "api.md")
    missing = [code.value for code in ErrorCode if f"`{code.value}`" not in page]
    assert not missing, f"error codes missing from docs/api.md: {missing}"


def test_every_metric_is_on_the_operations_page() -> None:
    page = _text(DOCS / "operations.md")
    info = SimpleNamespace(
        model="m",
        device="cpu",
        gpu="",
        id="w",
        host="h",
        continuous_batching=False,
        context_length=1,
        generated_tokens=0,
        adapters={"a": "/a"},
    )
    batcher = SimpleNamespace(  # the batcher's figures too (worker/engines/batcher)
        capacity=1,
        counters=BatcherCounters(),
        rows=lambda: (0, 0, 0),
        kv_tokens_reserved=0,
        kv_budget_tokens=1,
        prefix_cache_tokens=0,
    )
    worker = WorkerMetrics(
        CollectorRegistry(),
        SimpleNamespace(info=info, runs={}, engine=batcher, engine_restarts=0),
    )
    names = {
        metric.name
        for registry in (GatewayMetrics().registry, worker.registry)
        for metric in registry.collect()
    }
    assert names
    missing = sorted(name for name in names if name not in page)
    assert not missing, f"metrics missing from docs/operations.md: {missing}"


def test_the_readme_is_short_and_holds_no_history() -> None:
    readme = _text(ROOT / "README.md")
    assert len(readme.splitlines()) <= 300
    for phrase in ("this round", "last round", "previous round", "this session", "this sitting"):
        assert phrase not in readme.lower()


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in _text(page).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        heading = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.DOTALL)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in _links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"links in {page.relative_to(ROOT)} that lead nowhere: {broken}"
