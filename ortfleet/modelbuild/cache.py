from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.model_folder import (
    GENAI_CONFIG,
    MARKER_FORMAT,
    MARKER_NAME,
    FileRecord,
    Marker,
    files_match,
    is_complete,
    read_marker,
    sha256_of,
)

if sys.platform != "win32":
    import fcntl

logger = logging.getLogger(__name__)

_PARTIAL_INFIX = ".partial-"
_STALE_INFIX = ".stale-"

ModelBuild = Callable[[Path, Path], None]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    size: int
    complete: bool


class NotAModelFolder(FileExistsError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} exists and is not an ORT-GenAI model folder; refusing to replace it")
        self.path = path


def write_marker(model_dir: Path, *, source: str, recipe: str) -> Marker:
    """Record every file of ``model_dir`` (size and sha256) in its completeness marker.

    Call it as the last step of a build: a folder without a valid marker is never served.
    """
    marker: Marker = {
        "format": MARKER_FORMAT,
        "recipe": recipe,
        "source": source,
        "built_with": _built_with(),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "files": {name: _record(path) for name, path in _model_files(model_dir)},
    }
    tmp = model_dir / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(model_dir / MARKER_NAME)
    return marker


def list_models(cache_root: Path) -> list[ModelInfo]:
    """The model folders under ``cache_root``, by name, with their size on disk and completeness."""
    if not cache_root.is_dir():
        return []
    return [
        ModelInfo(name=path.name, path=path.absolute(), size=_folder_size(path), complete=is_complete(path))
        for path in sorted(cache_root.iterdir())
        if _looks_like_model(path)
    ]


def install_model(target: Path, build: ModelBuild, *, source: str, recipe: str, force: bool = False) -> Path:
    """Return ``target`` at once when it holds a complete build of ``recipe`` from ``source``; otherwise
    run ``build(scratch_dir, staging_dir)`` in a folder next to ``target``, write the marker and move the
    result into place with a rename, so ``target`` is never seen half-built. Concurrent callers wait on
    a lock instead of building twice."""
    target = target.expanduser().absolute()
    if not force and _is_current(target, source=source, recipe=recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if not force and _is_current(target, source=source, recipe=recipe):
            return target
        _ensure_replaceable(target)
        _remove_leftovers(target)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}{_PARTIAL_INFIX}", dir=target.parent))
        try:
            staged = work / "model"
            build(work, staged)
            write_marker(staged, source=source, recipe=recipe)
            _move_into_place(staged, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    logger.info("model ready at %s", target)
    return target


def _is_current(target: Path, *, source: str, recipe: str) -> bool:
    marker = read_marker(target)
    if marker is None:
        if _looks_like_model(target):
            logger.warning("%s has no valid %s marker; rebuilding it", target, MARKER_NAME)
        return False
    if marker["recipe"] != recipe or marker["source"] != source:
        logger.info("%s was built by %r from %r; rebuilding it", target, marker["recipe"], marker["source"])
        return False
    if not files_match(target, marker, verify_all_hashes=False):
        logger.warning("%s is incomplete or corrupt; rebuilding it", target)
        return False
    return True


def _model_files(model_dir: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and path.name != MARKER_NAME:
            yield path.relative_to(model_dir).as_posix(), path


def _record(path: Path) -> FileRecord:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def _built_with() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str] = {}
    for dist in ("onnxruntime-genai", "torch", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found


def _looks_like_model(path: Path) -> bool:
    if path.name.startswith(".") or not path.is_dir():
        return False
    return (path / MARKER_NAME).exists() or (path / GENAI_CONFIG).exists()


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _ensure_replaceable(target: Path) -> None:
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and (not any(target.iterdir()) or _looks_like_model(target)):
        return
    raise NotAModelFolder(target)


def _remove_leftovers(target: Path) -> None:
    for infix in (_PARTIAL_INFIX, _STALE_INFIX):
        for leftover in target.parent.glob(f".{target.name}{infix}*"):
            logger.info("removing %s left by an interrupted build", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _move_into_place(staged: Path, target: Path) -> None:
    if not target.exists() and not target.is_symlink():
        staged.rename(target)
        return
    stale = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STALE_INFIX}", dir=target.parent))
    target.rename(stale / "model")
    staged.rename(target)
    shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        if sys.platform != "win32":
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
