from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Required, TextIO, TypedDict, Unpack

from ortfleet.modelbuild.build_server import BuilderServer, ForkedBuild

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'ortfleet[model]'"
BUILDER_MODULE = "onnxruntime_genai.models.builder"
# The precision a model is built at for each device unless one is asked for.
DEFAULT_PRECISIONS = {"cpu": "int4", "cuda": "fp16"}
_DEVICE_OPTIONS: dict[str, dict[str, str]] = {"cpu": {}, "cuda": {"use_paged_attention": "true"}}
_OUTPUT_TAIL_LINES = 40
_OUTPUT_LINE_MAX_CHARS = 400
_EVENT_TOKEN = 1
_EVENT_FAILED = 8


class MissingModelExtras(RuntimeError):
    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"building models needs {', '.join(missing)}; install them with: {INSTALL_HINT}")
        self.missing = missing


class BuilderFailed(RuntimeError):
    def __init__(self, returncode: int, output_tail: str) -> None:
        super().__init__(
            f"{BUILDER_MODULE} exited with code {returncode}; the end of its output:\n{output_tail}"
        )
        self.returncode = returncode
        self.output_tail = output_tail


class ModelCheckFailed(RuntimeError):
    def __init__(self, model_dir: Path, reason: str) -> None:
        super().__init__(f"the model built in {model_dir} does not work with onnxruntime-genai: {reason}")
        self.model_dir = model_dir
        self.reason = reason


class StageProgress:
    """Numbered build stages on stderr with their elapsed time. A subprocess's output is summarized: on
    a terminal as a spinner line showing its latest line, elsewhere as a periodic heartbeat line."""

    heartbeat_seconds = 15.0
    refresh_seconds = 0.2
    _spinner = "|/-\\"

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self._total = total
        self._enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._live = enabled and self._stream.isatty()
        self._index = 0
        self._title = ""
        self._started = 0.0
        self._last_heartbeat = 0.0
        self._latest = ""

    @contextlib.contextmanager
    def stage(self, title: str) -> Iterator[None]:
        self._index += 1
        self._title = title
        self._latest = ""
        self._started = self._last_heartbeat = time.monotonic()
        self._write(f"{self._head()} ..." if self._live else f"{self._head()} ...\n")
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True)
        if self._live:
            ticker.start()
        outcome = "failed"
        try:
            yield
            outcome = "done"
        finally:
            stop.set()
            if self._live:
                ticker.join()
            self._finish(outcome)

    def note(self, line: str) -> None:
        if not self._enabled or not line:
            return
        self._latest = line
        now = time.monotonic()
        if not self._live and now - self._last_heartbeat >= self.heartbeat_seconds:
            self._write(f"      ... {now - self._started:.0f} s: {line[:100]}\n")
            self._last_heartbeat = now

    def _tick(self, stop: threading.Event) -> None:
        frame = 0
        while not stop.wait(self.refresh_seconds):
            frame += 1
            spin = self._spinner[frame % len(self._spinner)]
            status = f"{self._head()} ... {spin} {time.monotonic() - self._started:3.0f} s  {self._latest}"
            self._write(f"\r\x1b[K{status[: shutil.get_terminal_size().columns - 1]}")

    def _finish(self, outcome: str) -> None:
        elapsed = time.monotonic() - self._started
        prefix = "\r\x1b[K" if self._live else ""
        self._write(f"{prefix}{self._head()} {outcome} in {elapsed:.1f} s\n")

    def _head(self) -> str:
        return f"[{self._index}/{self._total}] {self._title}"

    def _write(self, text: str) -> None:
        if self._enabled:
            self._stream.write(text)
            self._stream.flush()


def require_modules(*modules: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingModelExtras(missing)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        if captured.getvalue():
            logger.debug("transformers output:\n%s", captured.getvalue())


def offline_environ() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class BuilderOptions(TypedDict, total=False):
    """The model builder's options besides its folders: what it makes and the module that runs it."""

    precision: Required[str]
    execution_provider: str
    extra_options: Mapping[str, str] | None
    runner: Sequence[str]


def builder_options(device: str, precision: str | None = None) -> BuilderOptions:
    """The builder's options for a model that runs on ``device`` ("cpu" or "cuda"), at ``precision`` or
    the device's default (:data:`DEFAULT_PRECISIONS`); a CUDA model gets paged attention, which gives
    og.Engine's dynamic (continuous) batching."""
    return {
        "precision": precision or DEFAULT_PRECISIONS[device],
        "execution_provider": device,
        "extra_options": dict(_DEVICE_OPTIONS[device]),
    }


def builder_command(
    hf_dir: Path, out_dir: Path, cache_dir: Path, **options: Unpack[BuilderOptions]
) -> list[str]:
    """The model builder's command line; ``extra_options`` become ``--extra_options key=value ...``.
    ``runner`` is the module run with ``-m`` and its own arguments: the builder itself by default, or a
    module that wraps it (random weights in place of a checkpoint's)."""
    return [sys.executable, "-m", *_module_arguments(hf_dir, out_dir, cache_dir, **options)]


def _module_arguments(
    hf_dir: Path,
    out_dir: Path,
    cache_dir: Path,
    *,
    precision: str,
    execution_provider: str = "cpu",
    extra_options: Mapping[str, str] | None = None,
    runner: Sequence[str] = (BUILDER_MODULE,),
) -> list[str]:
    """What follows ``python -m`` in :func:`builder_command`."""
    arguments = [
        *runner,
        "-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", execution_provider,
        "-c", str(cache_dir),
    ]  # fmt: skip
    if extra_options:
        arguments += ["--extra_options", *(f"{key}={value}" for key, value in extra_options.items())]
    return arguments


_server: BuilderServer | None = None
_server_guard = threading.Lock()


@contextlib.contextmanager
def builder_server(server: BuilderServer | None = None) -> Iterator[BuilderServer]:
    """While entered, :func:`run_builder` runs each build (in any thread of this process) in a child
    forked from ``server``, one process that imported the builder's modules, torch and transformers once
    (at its first build), in place of a fresh interpreter per build that imports them again; see
    :mod:`ortfleet.modelbuild.build_server`. Without ``server``, a new one, ended on exit. Builds then
    run one at a time."""
    global _server
    owned = server is None
    serving = BuilderServer(env=offline_environ()) if server is None else server
    with _server_guard:
        previous, _server = _server, serving
    try:
        yield serving
    finally:
        with _server_guard:
            _server = previous
        if owned:
            serving.close()


def cuda_available() -> bool:
    """Whether the installed onnxruntime-genai can run models on CUDA."""
    import onnxruntime_genai as og

    return bool(og.is_cuda_available())


def can_check(device: str, model: object) -> bool:
    """Whether onnxruntime-genai here can run a model built for ``device``, to check that it generates;
    where it cannot (CUDA without a CUDA build), a warning says that ``model``'s check is skipped."""
    if device == "cuda" and not cuda_available():
        logger.warning("skipped the check that %s generates: this onnxruntime-genai cannot use CUDA", model)
        return False
    return True


def run_builder(
    hf_dir: Path,
    out_dir: Path,
    cache_dir: Path,
    *,
    on_output: Callable[[str], None] | None = None,
    **options: Unpack[BuilderOptions],
) -> None:
    """Run the onnxruntime-genai model builder on a Hugging Face checkpoint folder, in a subprocess
    (creating models in-process does not work in onnxruntime-genai 0.18), or a child of the process's
    :func:`builder_server` while one is entered. Its output is passed line by line to ``on_output``; on
    failure :class:`BuilderFailed` carries the end of it. ``options``: as in :func:`builder_command`."""
    arguments = _module_arguments(hf_dir, out_dir, cache_dir, **options)
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL_LINES)
    with _start_builder(arguments) as process:
        assert process.stdout is not None
        try:
            for raw in process.stdout:
                line = raw.strip()[:_OUTPUT_LINE_MAX_CHARS]
                if line:
                    tail.append(line)
                    if on_output is not None:
                        on_output(line)
        except BaseException:
            process.kill()
            raise
        returncode = process.wait()
    if returncode != 0:
        raise BuilderFailed(returncode, "\n".join(tail))


def prepare_builder() -> None:
    """Start the imports of the entered :func:`builder_server` (if any, and not yet started), so that
    they run while the caller prepares its build's input."""
    with _server_guard:
        server = _server
    if server is not None:
        server.launch()


def _start_builder(arguments: list[str]) -> subprocess.Popen[str] | ForkedBuild:
    """``python -m`` with ``arguments``: a child of the entered builder server, else a subprocess."""
    with _server_guard:
        server = _server
    if server is not None:
        logger.debug("running %s in a child of the builder server", arguments)
        return server.start(arguments)
    command = [sys.executable, "-m", *arguments]
    logger.debug("running %s", command)
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=offline_environ(),
    )


def check_generates(model_dir: Path, *, chat: bool = True) -> None:
    """Load ``model_dir`` with onnxruntime-genai, format a chat prompt (with ``chat=False``, for a model
    without a chat template, a plain one) and generate one token."""
    try:
        flags = _generate_one_token(model_dir, chat=chat)
    except Exception as e:
        raise ModelCheckFailed(model_dir, str(e)) from e
    if not flags & _EVENT_TOKEN or flags & _EVENT_FAILED:
        raise ModelCheckFailed(model_dir, f"generation ended with event flags {flags:#x}")


def _generate_one_token(model_dir: Path, *, chat: bool) -> int:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    tokenizer = og.Tokenizer(model)
    prompt = "Hello!"
    if chat:
        messages = json.dumps([{"role": "user", "content": prompt}])
        prompt = tokenizer.apply_chat_template(messages=messages, add_generation_prompt=True)
    engine = og.Engine(model)
    request = engine.create_request()
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(1)
    options.set_do_sample(False)
    request.begin_turn(tokenizer.encode(prompt), options)
    buffer = engine.create_event_buffer(16)
    flags = 0
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            flags |= int(event.flags.value)
    request.close()
    return flags


def save_plain_checkpoint(gguf_model: Any, tokenizer: Any, hf_dir: Path) -> None:
    """Save the weights transformers read from a GGUF as a plain checkpoint of the same architecture (the
    GGUF-loaded model carries a GGUF quantization config, which the builder would not take)."""
    import torch

    settings = gguf_model.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(settings)
    with torch.device("meta"):
        plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
