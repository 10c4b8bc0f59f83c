"""`python -m ortfleet.bench.gpu_report DIR`: the figures scripts/gpu-report left in DIR (the benches'
JSON files, the `gpu` tests' JUnit XML, each step's exit status) merged into DIR/report.json and
DIR/report.md, with the card's name beside them."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from ortfleet.bench import serving

BENCHES = {
    "engine-graphs-off": "og.Engine alone, eager steps (ORTFLEET_CUDA_GRAPH=off)",
    "engine-graphs-on": "og.Engine alone, CUDA graphs for decode steps (ORTFLEET_CUDA_GRAPH=on)",
    "paged-engine": "ortfleet's paged engine alone (ORTFLEET_SCHEDULER=paged)",
    "paged-engine-graph": "the paged engine alone, the sampler graph picking (ORTFLEET_SAMPLING=graph)",
    "paged-engine-eager": "the paged engine alone, eager runs (ORTFLEET_CUDA_GRAPH=off)",
    "serving-paged": "the paged engine through the fleet, the sampler graph picking",
    "serving": "default model, engine alone and fleet",
    "serving-shared-core2": "default model, two frontends of one engine core",
    "serving-shared-core4": "default model, four frontends of one engine core",
    "serving-in-process": "default model, one worker with its engine in its own process",
    "serving-workers2": "default model, two workers sharing the card",
    "serving-workers4": "default model, four workers sharing the card",
    "serving-phi3": "Phi-3-mini shape (random weights), fp16",
    "sweep": "default model, a worker of 256 rows: where ITL grows",
    "overhead": "`ortfleet bench`: the fleet against its engine in-process",
}
OTHER = {  # shown as their JSON
    "paged-host": "the paged engine's host CPU a step on a fake paged device of 4 ms runs (no card used)",
    "paged-host-driven": "the paged engine's own host CPU a step, stepped back to back (no card used)",
    "sampler-graph-cuda": "the sampler graph on the CUDA provider, logits on the card",
    "paged-model": "the paged model run by ortfleet: tokens against og.Engine's, decode run times",
    "worker-host": "fake engine, 256 rows every 4 ms: a worker's CPU per token and share of the offered rate",
    "worker-host-512": "fake engine, 512 rows every 4 ms over two frontends of one engine core",
}


def collect(folder: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"card": _read(folder / "card.txt").strip(), "steps": [], "benches": {}}
    steps = folder / "steps.jsonl"
    if steps.is_file():
        report["steps"] = [json.loads(line) for line in steps.read_text().splitlines() if line.strip()]
    for name in [*BENCHES, *OTHER]:
        path = folder / f"{name}.json"
        if path.is_file():
            report["benches"][name] = json.loads(path.read_text())
    report["gpu_tests"] = _junit(folder / "gpu-tests.xml")
    samples = _samples(folder / "gpu-samples.csv")
    for step in report["steps"]:
        step["gpu"] = _busy(samples, step)
    return report


def _samples(path: Path) -> list[tuple[int, float, float]]:
    """(epoch second, GPU utilization %, memory used MiB) of each line scripts/gpu-report sampled."""
    rows = []
    for line in _read(path).splitlines():
        try:
            second, utilization, memory = (part.strip() for part in line.split(","))
            rows.append((int(second), float(utilization), float(memory)))
        except ValueError:
            continue  # a sample nvidia-smi could not give
    return rows


def _busy(samples: list[tuple[int, float, float]], step: dict[str, Any]) -> dict[str, float] | None:
    """How busy the card was during a step: mean and peak utilization, peak memory used."""
    start = step.get("start")
    if start is None:
        return None
    inside = [s for s in samples if start <= s[0] <= start + step["seconds"]]
    if not inside:
        return None
    utilization = [s[1] for s in inside]
    return {
        "utilization_mean_pct": round(sum(utilization) / len(utilization), 1),
        "utilization_max_pct": max(utilization),
        "memory_max_mib": max(s[2] for s in inside),
    }


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _junit(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    root = ElementTree.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
            elif child.tag == "skipped":
                outcome = "skipped"
        message = next((c.get("message", "") for c in case if c.tag in ("failure", "error")), "")
        cases.append({"name": case.get("name"), "outcome": outcome, "message": message[:400]})
    return {
        "passed": sum(1 for c in cases if c["outcome"] == "passed"),
        "failed": sum(1 for c in cases if c["outcome"] in ("failure", "error")),
        "skipped": sum(1 for c in cases if c["outcome"] == "skipped"),
        "cases": cases,
    }


def markdown(report: dict[str, Any]) -> str:
    parts = [f"# GPU report: {report['card'] or 'card unknown'}", ""]
    parts += ["| step | exit | seconds | GPU utilization mean / max (%) | GPU memory max (MiB) |"]
    parts += ["| --- | --- | --- | --- | --- |"]
    for s in report["steps"]:
        gpu = s.get("gpu") or {}
        busy = f"{gpu['utilization_mean_pct']} / {gpu['utilization_max_pct']}" if gpu else ""
        memory = gpu.get("memory_max_mib", "")
        parts.append(f"| {s['step']} | {s['rc']} | {s['seconds']} | {busy} | {memory} |")
    for name, title in BENCHES.items():
        figures = report["benches"].get(name)
        if figures is None:
            continue
        parts += ["", f"## {name}: {title}", "", f"`{figures.get('command_line', '')}`", ""]
        if name == "overhead":
            parts += [
                "```",
                json.dumps(figures.get("goals", figures.get("levels", [])), indent=1)[:4000],
                "```",
            ]
        else:
            parts += ["```", serving.text(figures), "```"]
    for name, title in OTHER.items():
        figures = report["benches"].get(name)
        if figures is not None:
            shown = {k: v for k, v in figures.items() if k != "machine"}
            parts += ["", f"## {name}: {title}", "", "```", json.dumps(shown, indent=1)[:6000], "```"]
    tests = report["gpu_tests"]
    if tests is not None:
        parts += [
            "",
            f"## gpu tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped",
            "",
        ]
        parts += [f"- {c['outcome']}: {c['name']} {c['message']}".rstrip() for c in tests["cases"]]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ortfleet.bench.gpu_report DIR", file=sys.stderr)
        return 2
    folder = Path(args[0])
    report = collect(folder)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
