"""What a built model folder is, for every process that opens one: its completeness marker, the check that
a folder is complete, and where the default model lives. Building models is `ortfleet.modelbuild`'s job."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, TypedDict, cast

MARKER_NAME = ".ortfleet-model.json"
MARKER_FORMAT = 1
HASH_VERIFIED_MAX_BYTES = 8 * 1024 * 1024
GENAI_CONFIG = "genai_config.json"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-int4-cpu"
DEFAULT_CUDA_MODEL_NAME = "smollm2-135m-instruct-fp16-cuda-paged"
DEFAULT_MODEL_FOLDERS = {"cpu": DEFAULT_MODEL_NAME, "cuda": DEFAULT_CUDA_MODEL_NAME}
_HASH_CHUNK_BYTES = 1024 * 1024


class FileRecord(TypedDict):
    size: int
    sha256: str


class Marker(TypedDict):
    format: int
    recipe: str
    source: str
    built_with: dict[str, str]
    created_at: str
    files: dict[str, FileRecord]


def default_cache_root() -> Path:
    """Where models are cached unless configured: ``$XDG_CACHE_HOME/ortfleet/models``,
    falling back to ``~/.cache/ortfleet/models`` (a relative ``XDG_CACHE_HOME`` is ignored, as the XDG
    spec requires)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "ortfleet" / "models"


def default_model_dir(cache_root: Path, device: str = "cpu") -> Path:
    """Where `ortfleet model default` puts the default model for ``device`` under ``cache_root``."""
    try:
        name = DEFAULT_MODEL_FOLDERS[device]
    except KeyError:
        raise ValueError(
            f"the default model is built for {' or '.join(DEFAULT_MODEL_FOLDERS)}, not {device!r}"
        ) from None
    return (cache_root / name).expanduser().absolute()


def read_marker(model_dir: Path) -> Marker | None:
    try:
        data: Any = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT:
        return None
    if not isinstance(data.get("files"), dict) or GENAI_CONFIG not in data["files"]:
        return None
    return cast(Marker, data)


def is_complete(model_dir: Path, *, verify_all_hashes: bool = False) -> bool:
    """True when ``model_dir`` holds a finished build: its marker lists every file with the size found
    on disk, and the sha256 matches for every file up to ``HASH_VERIFIED_MAX_BYTES`` (configs and
    tokenizer), or for all files with ``verify_all_hashes``."""
    marker = read_marker(model_dir)
    return marker is not None and files_match(model_dir, marker, verify_all_hashes=verify_all_hashes)


def missing_files(model_dir: Path) -> list[str]:
    """The files that the folder's build marker lists and the folder lacks (none without a marker)."""
    marker = read_marker(model_dir)
    if marker is None:
        return []
    return [name for name in marker["files"] if not (model_dir / name).is_file()]


def files_match(model_dir: Path, marker: Marker, *, verify_all_hashes: bool) -> bool:
    return not mismatched_files(model_dir, marker, verify_all_hashes=verify_all_hashes)


def mismatched_files(model_dir: Path, marker: Marker, *, verify_all_hashes: bool) -> list[str]:
    """The files the marker lists that are missing or differ from it: by size, or by sha256 for files up
    to ``HASH_VERIFIED_MAX_BYTES`` (all files with ``verify_all_hashes``, read a chunk at a time)."""
    mismatched = []
    for name, record in marker["files"].items():
        path = model_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            mismatched.append(name)
            continue
        if size != record["size"]:
            mismatched.append(name)
        elif (verify_all_hashes or size <= HASH_VERIFIED_MAX_BYTES) and sha256_of(path) != record["sha256"]:
            mismatched.append(name)
    return mismatched


def served_fingerprint(model_dir: Path | None) -> str:
    """The fingerprint of what a worker or an engine core serves: its model folder's, or the fake
    engine's (no folder)."""
    return "fake-engine" if model_dir is None else model_fingerprint(model_dir)


def model_fingerprint(model_dir: Path) -> str:
    """What tells one model from another, whatever its folder: with a build marker, a digest of the
    sha256 of every file it lists (weights included); without one, of genai_config.json, the tokenizer's
    files and the size of every other file. Workers of one served name must have the same."""
    digest = hashlib.sha256()
    marker = read_marker(model_dir)
    if marker is not None:
        for name, record in sorted(marker["files"].items()):
            digest.update(f"{name}\0{record['sha256']}\0".encode())
        return digest.hexdigest()[:16]
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MARKER_NAME):
        if path.name == GENAI_CONFIG or path.name.startswith("tokenizer"):
            digest.update(f"{path.name}\0{sha256_of(path)}\0".encode())
        else:
            digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
