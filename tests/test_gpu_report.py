"""`scripts/gpu-report`'s merge: what its steps leave in a folder becomes one JSON and one markdown
report with the card's name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from ortfleet.bench import gpu_report

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu" name="test_a_chat_on_the_gpu_answers_the_capital_of_france"/>
<testcase classname="tests.test_gpu" name="test_stop_strings_end_a_gpu_completion_before_the_stop_text">
<failure message="AssertionError: assert 'Paris' not in 'The capital of France is Paris'">...</failure>
</testcase>
<testcase classname="tests.test_gpu" name="test_skipped_here"><skipped message="no CUDA"/></testcase>
</testsuite></testsuites>
"""


def test_a_gpu_runs_figures_merge_into_one_json_and_one_markdown_report(tmp_path: Path) -> None:
    shutil.copy(ROOT / "docs" / "bench" / "gpu-h200-serving.json", tmp_path / "serving.json")
    (tmp_path / "card.txt").write_text("NVIDIA H200, 143771 MiB, 580.159.04\n")
    steps = [
        {"step": "model-default", "rc": 0, "start": 1000, "seconds": 46},
        {"step": "gpu-tests", "rc": 1, "start": 1046, "seconds": 30},
    ]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    # a second's sample each: busy while building, idle in the tests but for one unreadable sample
    samples = [f"{t},{90 if t < 1046 else 10},{2000 + t - 1000}" for t in range(1000, 1077)]
    (tmp_path / "gpu-samples.csv").write_text("\n".join([*samples, "1050,[N/A],[N/A]"]) + "\n")
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)

    assert gpu_report.main([str(tmp_path)]) == 0

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["card"].startswith("NVIDIA H200")
    assert [{k: v for k, v in s.items() if k != "gpu"} for s in report["steps"]] == steps
    building, testing = (s["gpu"] for s in report["steps"])
    assert building["utilization_max_pct"] == 90 and building["memory_max_mib"] == 2046
    assert testing["utilization_mean_pct"] == 10 and testing["memory_max_mib"] == 2076
    assert list(report["benches"]) == ["serving"]  # the steps that left no JSON are left out
    tests = report["gpu_tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert "'Paris' not in" in tests["cases"][1]["message"]
    page = (tmp_path / "report.md").read_text()
    assert page.startswith("# GPU report: NVIDIA H200")
    assert "| gpu-tests | 1 | 30 | 10.0 / 10.0 | 2076.0 |" in page
    assert "engine alone" in page and "ortfleet bench serving" in page  # the bench's own table and command
    assert "tok/s  steady tok/s" in page  # a run's file from before the steady window shows "-" there
    assert "failure: test_stop_strings_end_a_gpu_completion_before_the_stop_text" in page


def test_the_gpu_report_script_parses_and_names_every_bench_it_runs() -> None:
    script = ROOT / "scripts" / "gpu-report"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    for name in [*gpu_report.BENCHES, *gpu_report.OTHER]:
        assert f'"$OUT/{name}.json"' in text


def test_the_gpu_test_wheels_are_locked_and_cover_what_the_gpu_tests_import_beyond_the_runtime() -> None:
    script = ROOT / "scripts" / "gpu-test-wheels"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    listed = set(re.search(r"PACKAGES=\(([^)]*)\)", text).group(1).split())  # type: ignore[union-attr]
    locked = {p["name"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    assert listed <= locked, listed - locked
    # what tests/test_gpu.py, tests/conftest.py and the helpers they import take from the dev extra
    assert {"pytest", "pytest-asyncio", "pytest-timeout", "httpx-sse", "openai", "jsonschema"} <= listed
    assert {"referencing", "jsonpointer", "httpx2", "sniffio", "jiter"} <= listed  # found missing on a host
