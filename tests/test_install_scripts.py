"""The README's two commands find their environment even when every tool they run prints on stdout.

scripts/setup runs apt-get, sudo and uv, which print progress on stdout. These tests put stand-ins for
them (and for the environment's own tools) on a PATH from which a Debian package's command is hidden,
as on a fresh machine, and check what scripts/test and scripts/fleet then run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LOUD = 'echo "Reading package lists... Done"; echo "Progress: [ 42%] [####......]"'


def _write_tool(path: Path, body: str) -> None:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def _environment_tool(name: str) -> str:
    """A tool of the project environment that logs how it was called and prints on stdout."""
    return f'echo "{name} $*" >> "$TOOLS_LOG"; echo "{name} is done"'


def _machine(tmp_path: Path, hidden: set[str]) -> dict[str, str]:
    """An environment whose PATH holds /usr/bin without `hidden`, and loud stand-ins for apt-get, sudo,
    id (a user other than root, so sudo is used) and uv (whose sync creates the project environment)."""
    usr_bin = tmp_path / "usr-bin"
    usr_bin.mkdir()
    for entry in Path("/usr/bin").iterdir():
        if entry.name not in hidden | {"apt-get", "sudo", "id", "uv"}:
            (usr_bin / entry.name).symlink_to(entry)
    stand_ins = tmp_path / "stand-ins"
    stand_ins.mkdir()
    _write_tool(stand_ins / "apt-get", f'echo "apt-get $*" >> "$APT_LOG"; {LOUD}')
    _write_tool(stand_ins / "sudo", f'echo "sudo $*" >> "$APT_LOG"; {LOUD}; exec "$@"')
    _write_tool(stand_ins / "id", 'if [ "$1" = -u ]; then echo 1000; else exec /usr/bin/id "$@"; fi')
    tools = "\n".join(
        f"cat > \"$UV_PROJECT_ENVIRONMENT/bin/{name}\" <<'TOOL'\n#!/usr/bin/env bash\n"
        f'{_environment_tool(name)}\nTOOL\nchmod +x "$UV_PROJECT_ENVIRONMENT/bin/{name}"'
        for name in ("python", "ruff", "mypy", "lint-imports", "ortfleet")
    )
    _write_tool(
        stand_ins / "uv",
        f"""case "$1" in
  --version) echo "uv 0.13.9" ;;
  sync) echo "uv $*" >> "$TOOLS_LOG"; {LOUD}; mkdir -p "$UV_PROJECT_ENVIRONMENT/bin"
{tools} ;;
  *) echo "uv $*" >> "$TOOLS_LOG"; {LOUD} ;;
esac""",
    )
    return {
        "PATH": f"{stand_ins}:{usr_bin}",
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "ORTFLEET_VENV": str(tmp_path / "venv"),
        "APT_LOG": str(tmp_path / "apt.log"),
        "TOOLS_LOG": str(tmp_path / "tools.log"),
    }


# What scripts/test runs again with each worker's engine in an engine core of its own.
ENGINE_CORE_SET = [
    f"tests/test_{name}.py"
    for name in (
        "jobs", "openai_parameters", "logprobs", "stop_strings", "structured_closing", "prefix_cache",
        "engine_failures", "reliability", "recovery", "recovery_default_model", "lora_fleet",
    )
]  # fmt: skip
# What scripts/test runs again on a Redis Cluster (ORTFLEET_TEST_REDIS=cluster).
CLUSTER_SET = [f"tests/test_{name}.py" for name in ("jobs", "openai_api", "batches", "queue_order")]


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _log(env: dict[str, str], name: str) -> list[str]:
    path = Path(env[name])
    return path.read_text().splitlines() if path.exists() else []


def test_setup_prints_nothing_on_stdout_while_apt_and_uv_do(tmp_path: Path) -> None:
    env = _machine(tmp_path, hidden={"redis-sentinel"})
    done = _run(["bash", "scripts/setup", "test"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "Reading package lists" in done.stderr


@pytest.mark.parametrize(
    ("arguments", "pytest_runs"),
    [
        (["-k", "something"], ["python -m pytest -q --durations=25 -k something"]),
        (
            [],
            [
                "python -m pytest -q -m unit",
                "python -m pytest -q --durations=25 -m not unit -n 2 --dist loadfile",
                "python -m pytest -q -m not unit -n 2 --dist loadfile " + " ".join(ENGINE_CORE_SET),
                "python -m pytest -q -m not unit -n 2 --dist loadfile " + " ".join(CLUSTER_SET),
            ],
        ),
    ],
    ids=["arguments", "unit-tier-first-then-two-processes-then-engine-cores-then-a-cluster"],
)
def test_scripts_test_installs_a_hidden_package_and_runs_the_environment_s_tools(
    tmp_path: Path, arguments: list[str], pytest_runs: list[str]
) -> None:
    env = _machine(tmp_path, hidden={"redis-sentinel"})
    done = _run(["bash", "scripts/test", *arguments], env)
    assert done.returncode == 0, done.stderr
    assert "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-sentinel" in _log(
        env, "APT_LOG"
    )
    assert "apt-get install -y -q redis-sentinel" in _log(env, "APT_LOG")
    tools = _log(env, "TOOLS_LOG")
    assert tools[0] == "uv sync --frozen --inexact --extra model --extra dev --extra clients --quiet"
    assert tools[-4 - len(pytest_runs) :] == [
        "ruff check .",
        "ruff format --check .",
        "mypy ",
        "lint-imports ",
        *pytest_runs,
    ]
    assert done.stdout.splitlines() == [
        "ruff is done",
        "ruff is done",
        "mypy is done",
        "lint-imports is done",
        *["python is done"] * len(pytest_runs),
    ]
    assert os.path.isdir(env["ORTFLEET_VENV"])


def test_scripts_fleet_installs_only_what_a_fleet_needs(tmp_path: Path) -> None:
    env = _machine(tmp_path, hidden={"redis-server", "redis-sentinel", "chromium", "prometheus"})
    done = _run(["bash", "scripts/fleet", "--workers", "2"], env)
    assert done.returncode == 0, done.stderr
    installs = [line for line in _log(env, "APT_LOG") if line.startswith("apt-get install")]
    assert installs == ["apt-get install -y -q redis-server"]
    tools = _log(env, "TOOLS_LOG")
    assert tools[0] == "uv sync --frozen --inexact --extra model --quiet"
    assert tools[-1] == "ortfleet up --workers 2"


def test_setup_installs_nothing_from_debian_when_every_command_is_there(tmp_path: Path) -> None:
    env = _machine(tmp_path, hidden=set())
    for name in ("redis-server", "redis-sentinel", "prometheus", "promtool", "chromium", "chromedriver"):
        path = Path(env["PATH"].split(":")[0]) / name
        if not path.exists():
            _write_tool(path, "exit 0")
    done = _run(["bash", "scripts/setup", "test"], env)
    assert done.returncode == 0, done.stderr
    assert _log(env, "APT_LOG") == []


def test_setup_refuses_an_unknown_profile(tmp_path: Path) -> None:
    done = _run(["bash", "scripts/setup", "everything"], _machine(tmp_path, hidden=set()))
    assert done.returncode == 2
    assert "usage: scripts/setup fleet|test" in done.stderr
