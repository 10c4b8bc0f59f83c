"""What `ortfleet model convert` takes: a Hugging Face checkpoint folder or a GGUF file, checked before
anything is built (each refusal one line naming the problem), and its fingerprint, which tells whether a
cached conversion is still of the same source."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

SourceKind = Literal["checkpoint", "gguf"]
CHECKPOINT: Final = "checkpoint"
GGUF: Final = "gguf"
CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_BUILDER_SOURCE = ("models", "builder.py")
_UNSAFE_NAME_CHARACTERS = re.compile(r"[^a-z0-9._]+")


class UnconvertibleSource(ValueError):
    """A source the model builder cannot convert, with the reason in one line."""

    def __init__(self, source: Path, reason: str) -> None:
        super().__init__(f"cannot convert {source}: {reason}")
        self.source = source
        self.reason = reason


@dataclass(frozen=True)
class ModelSource:
    """A checked source: its absolute path, its kind, and, for a checkpoint folder, the architecture its
    config.json names (a GGUF's is known only once transformers reads it)."""

    path: Path
    kind: SourceKind
    architecture: str | None = None

    @property
    def slug(self) -> str:
        """The source's file or folder name (without ``.gguf``) in lowercase safe characters."""
        stem = self.path.stem if self.kind == GGUF else self.path.name
        return _UNSAFE_NAME_CHARACTERS.sub("-", stem.lower()).strip("-.") or "model"


def inspect_source(path: Path) -> ModelSource:
    """Check that ``path`` is a source the builder can take: a folder with a config.json naming an
    architecture the installed model builder converts, weights and a tokenizer; or a ``.gguf`` file
    (whose contents transformers checks when it reads it). Raises :class:`UnconvertibleSource`."""
    path = path.expanduser().absolute()
    if not path.exists():
        raise UnconvertibleSource(path, "not found")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(path, GGUF)
    if not path.is_dir() or not (path / CONFIG_FILE).is_file():
        raise UnconvertibleSource(
            path, f"neither a Hugging Face checkpoint folder (with a {CONFIG_FILE}) nor a .gguf file"
        )
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise UnconvertibleSource(path, f"no weights in the folder ({' or '.join(WEIGHT_PATTERNS)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UnconvertibleSource(path, f"no tokenizer in the folder ({' or '.join(TOKENIZER_FILES)})")
    architecture = _config_architecture(path)
    check_architecture(path, architecture)
    return ModelSource(path, CHECKPOINT, architecture)


def check_architecture(source: Path, architecture: str) -> None:
    """Refuse ``architecture`` when the installed model builder is known not to convert it."""
    supported = builder_architectures()
    if supported and architecture not in supported:
        raise UnconvertibleSource(
            source,
            f"its architecture {architecture} is not one that the model builder of onnxruntime-genai "
            f"{_builder_version()} converts",
        )


@functools.cache
def builder_architectures() -> frozenset[str]:
    """The architectures (transformers class names) that the installed model builder dispatches on, read
    from its source without importing it (that imports torch); empty when they cannot be read there, and
    then the builder's own refusal names the architecture."""
    spec = importlib.util.find_spec("onnxruntime_genai")
    if spec is None or spec.origin is None:
        return frozenset()
    try:
        tree = ast.parse(Path(spec.origin).parent.joinpath(*_BUILDER_SOURCE).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    return frozenset(_compared_architectures(tree))


def _compared_architectures(tree: ast.AST) -> set[str]:
    """The strings compared with ``<anything>.architectures[...]`` in ``tree``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        if not (isinstance(left, ast.Subscript) and isinstance(left.value, ast.Attribute)):
            continue
        if left.value.attr != "architectures":
            continue
        for compared in node.comparators:
            values = compared.elts if isinstance(compared, ast.Tuple | ast.List | ast.Set) else [compared]
            found |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return found


def source_fingerprint(source: ModelSource) -> str:
    """What identifies the source's contents, cheaply: each file's path, size and modification time (in
    nanoseconds), not a hash of the contents, so a large checkpoint is not read to learn that it has not
    changed. Hidden files and folders (``.git``, ``.cache``) are left out."""
    digest = hashlib.sha256()
    for path in _source_files(source):
        stat = path.stat()
        name = path.relative_to(source.path).as_posix() if source.kind == CHECKPOINT else path.name
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _source_files(source: ModelSource) -> list[Path]:
    if source.kind == GGUF:
        return [source.path]
    return sorted(
        path
        for path in source.path.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(source.path).parts)
    )


def _config_architecture(folder: Path) -> str:
    try:
        config: Any = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnconvertibleSource(folder, f"its {CONFIG_FILE} cannot be read: {e}") from e
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise UnconvertibleSource(folder, f'its {CONFIG_FILE} names no architecture ("architectures")')
    return architectures[0]


def _builder_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("onnxruntime-genai", "onnxruntime-genai-cuda"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "(version unknown)"
