"""A team's own model: a Hugging Face checkpoint folder or a GGUF file converted offline by
onnxruntime-genai's model builder into the model cache, under a name that says what it is, and converted
again only when the source changes (see :mod:`ortfleet.modelbuild.own_source`)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from ortfleet.modelbuild.cache import install_model
from ortfleet.modelbuild.convert import (
    DEFAULT_PRECISIONS,
    BuilderFailed,
    StageProgress,
    builder_options,
    can_check,
    check_generates,
    prepare_builder,
    quiet_transformers,
    require_modules,
    run_builder,
    save_plain_checkpoint,
)
from ortfleet.modelbuild.own_source import (
    GGUF,
    ModelSource,
    UnconvertibleSource,
    check_architecture,
    inspect_source,
    source_fingerprint,
)

logger = logging.getLogger(__name__)

OWN_MODEL_RECIPE = "own-model/1"
CONVERT_DEVICES = ("cpu", "cuda")
# The precisions onnxruntime-genai's builder makes for each device; on CUDA, those it can give paged
# attention (fp16 or bf16 activations), which og.Engine's continuous batching needs.
DEVICE_PRECISIONS = {"cpu": ("int4", "int8", "fp32"), "cuda": ("fp16", "bf16", "int4", "int8")}
PRECISIONS = ("int4", "int8", "fp16", "bf16", "fp32")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BUILDER_ERROR = re.compile(r"^(?:\w+\.)*(NotImplementedError|ValueError): (.+)$")
_REQUIRED_MODULES = ("torch", "transformers", "onnx_ir", "onnxscript")
_GGUF_MODULES = ("gguf", "accelerate")
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def own_model_name(source: ModelSource, precision: str, device: str) -> str:
    """The cache folder of ``source`` built at ``precision`` for ``device``: for example
    ``qwen2.5-0.5b-instruct-int4-cpu``, or ``...-fp16-cuda-paged``."""
    return f"{source.slug}-{precision}-{device}" + ("-paged" if device == "cuda" else "")


def convert_own_model(
    source_path: Path,
    cache_root: Path,
    *,
    precision: str | None = None,
    device: str = "cpu",
    name: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a Hugging Face checkpoint folder or a ``.gguf`` file into an ORT-GenAI model folder under
    ``cache_root`` (``name``, or :func:`own_model_name`), offline, and return its absolute path.

    ``precision`` defaults to int4 on the CPU and fp16 on CUDA; a CUDA model gets paged attention. A
    GGUF is read by transformers (dequantized, in memory) and saved as a plain checkpoint first. The
    folder is returned at once when it holds a build of the same source (:func:`source_fingerprint`)
    with the same precision and device, unless ``force``. A source that cannot be converted raises
    :class:`UnconvertibleSource`, whose message is one line; the check that the model generates is
    skipped for CUDA where onnxruntime-genai cannot use it. Progress goes to stderr."""
    source = inspect_source(source_path)
    precision = _checked_precision(precision, device)
    folder = _checked_name(name) if name is not None else own_model_name(source, precision, device)
    fingerprint = source_fingerprint(source)

    def build(work: Path, staged: Path) -> None:
        stages = 4 if source.kind == GGUF else 2
        _convert(work, staged, source, precision, device, StageProgress(stages, enabled=progress))

    return install_model(
        cache_root / folder,
        build,
        source=f"{source.kind} {source.path}, files {fingerprint}",
        recipe=f"{OWN_MODEL_RECIPE}/{precision}/{device}",
        force=force,
    )


def _checked_precision(precision: str | None, device: str) -> str:
    if device not in CONVERT_DEVICES:
        raise ValueError(f"models are converted for {' or '.join(CONVERT_DEVICES)}, not {device!r}")
    chosen = precision or DEFAULT_PRECISIONS[device]
    if chosen not in DEVICE_PRECISIONS[device]:
        raise ValueError(
            f"the model builder makes {', '.join(DEVICE_PRECISIONS[device])} models for {device}, "
            f"not {chosen}"
        )
    return chosen


def _checked_name(name: str) -> str:
    if not _SAFE_NAME.fullmatch(name):
        raise ValueError(
            "a model name is letters, digits, '.', '_' and '-', starting with a letter or digit, "
            f"not {name!r}"
        )
    return name


def _convert(
    work: Path, staged: Path, source: ModelSource, precision: str, device: str, progress: StageProgress
) -> None:
    require_modules(*_REQUIRED_MODULES, *(_GGUF_MODULES if source.kind == GGUF else ()))
    prepare_builder()
    if source.kind == GGUF:
        hf_dir = work / "hf"
        with progress.stage(f"loading {source.path.name}"), quiet_transformers():
            model, tokenizer = _load_gguf(source.path)
        architecture = type(model).__name__
        with progress.stage(f"saving a {architecture} checkpoint"), quiet_transformers():
            save_plain_checkpoint(model, tokenizer, hf_dir)
        del model
    else:
        hf_dir, architecture = source.path, source.architecture or "its architecture"
    logger.info(
        "converting %s (%s) into a %s %s ORT-GenAI model", source.path, architecture, precision, device
    )
    with progress.stage(f"building the {precision} {device} ONNX model of {architecture}"):
        _run_builder(
            hf_dir, staged, work / "builder-cache", source, architecture, precision, device, progress
        )
    with progress.stage("checking that onnxruntime-genai runs it"):
        if not can_check(device, f"the model of {source.path}"):
            return
        chat = has_chat_template(staged)
        if not chat:
            logger.warning(
                "%s has no chat template: its model serves completions, and chat requests to it fail",
                source.path,
            )
        check_generates(staged, chat=chat)


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer files the builder wrote into ``model_dir`` hold a chat template."""
    if any((model_dir / name).is_file() for name in _CHAT_TEMPLATE_FILES):
        return True
    try:
        settings = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and bool(settings.get("chat_template"))


def _run_builder(
    hf_dir: Path,
    staged: Path,
    cache_dir: Path,
    source: ModelSource,
    architecture: str,
    precision: str,
    device: str,
    progress: StageProgress,
) -> None:
    """The builder on ``hf_dir``; a refusal it states (NotImplementedError or ValueError as its last
    words) becomes one line naming the architecture, any other failure stays a BuilderFailed with the
    end of its output."""
    try:
        run_builder(hf_dir, staged, cache_dir, on_output=progress.note, **builder_options(device, precision))
    except BuilderFailed as e:
        refusal = next(
            (m for line in reversed(e.output_tail.splitlines()) if (m := _BUILDER_ERROR.match(line))), None
        )
        if refusal is None:
            raise
        reason = f"the model builder refused {architecture} at {precision} for {device}: {refusal.group(2)}"
        raise UnconvertibleSource(source.path, reason) from e


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    """The model and tokenizer transformers reads from ``gguf``, once its architecture is known to be one
    that transformers reads from a GGUF and the model builder converts."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as e:
        raise UnconvertibleSource(gguf, f"transformers cannot read it as a GGUF: {_first_line(e)}") from e
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture is None:
        raise UnconvertibleSource(gguf, f"transformers has no text-generation model for {config.model_type}")
    check_architecture(gguf, architecture)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except Exception as e:
        raise UnconvertibleSource(gguf, f"transformers cannot read its tokenizer: {_first_line(e)}") from e
    return model, tokenizer


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
