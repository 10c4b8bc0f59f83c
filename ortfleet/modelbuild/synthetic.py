"""Random-weight models with a real model's architecture, built from its config alone (no download):
the size and speed of the real thing for benchmarks, noise for text."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ortfleet.modelbuild.cache import install_model
from ortfleet.modelbuild.convert import (
    StageProgress,
    builder_options,
    can_check,
    check_generates,
    prepare_builder,
    quiet_transformers,
    require_modules,
    run_builder,
)
from ortfleet.modelbuild.tiny import SPECIAL_TOKENS, chatml_tokenizer

logger = logging.getLogger(__name__)

SYNTHETIC_RECIPE = "synthetic-random-weights/2"
RANDOM_WEIGHTS_MODULE = "ortfleet.modelbuild.random_weights"
SYNTHETIC_DEVICES = ("cpu", "cuda")
_REQUIRED_MODULES = ("torch", "transformers", "tokenizers", "onnx_ir", "onnxscript")
_HEAD_SIZE_STEP = 16
_MLP_STEP = 64  # whole int4 quantization blocks


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's architecture: what its config says, without its weights. ``architecture`` is the
    transformers class the builder sees (and the random weights are made with); ``config_overrides``
    are further config.json entries, or ones that replace what the fields give."""

    name: str
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    config_overrides: tuple[tuple[str, Any], ...] = ()

    def resized(self, *, layers: int | None = None, hidden: int | None = None) -> Shape:
        """This shape with fewer layers and/or a smaller hidden size (the MLP shrinks in proportion),
        so that tests and CPU builds stay small; the vocabulary and the head count are kept."""
        shape = self
        if layers is not None:
            if not 1 <= layers <= self.num_layers:
                raise ValueError(
                    f"--layers must be from 1 to {self.num_layers} for {self.name}, not {layers}"
                )
            shape = dataclasses.replace(shape, num_layers=layers)
        if hidden is not None:
            # ORT's CPU GroupQueryAttention needs a head size that is a multiple of 16.
            step = _HEAD_SIZE_STEP * self.num_heads
            if not 1 <= hidden <= self.hidden_size or hidden % step:
                raise ValueError(
                    f"--hidden must be a multiple of {step} (head sizes a multiple of {_HEAD_SIZE_STEP}) up "
                    f"to {self.hidden_size} for {self.name}, not {hidden}"
                )
            scaled = self.intermediate_size * hidden // self.hidden_size
            intermediate = max(_MLP_STEP, scaled // _MLP_STEP * _MLP_STEP)
            shape = dataclasses.replace(shape, hidden_size=hidden, intermediate_size=intermediate)
        return shape

    def describe(self) -> str:
        return (
            f"{self.name} ({self.architecture}): {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads} heads, {self.num_kv_heads} KV heads, MLP {self.intermediate_size}, "
            f"vocab {self.vocab_size}, context {self.context_length}"
        )


PHI3_MINI = Shape(
    name="phi3-mini",
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    hidden_size=3072,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    intermediate_size=8192,
    vocab_size=32064,
    context_length=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    config_overrides=(("original_max_position_embeddings", 4096),),  # not LongRoPE: the 4k model
)
LLAMA3_8B = Shape(
    name="llama3-8b",
    architecture="LlamaForCausalLM",
    model_type="llama",
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    context_length=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
QWEN25_7B = Shape(
    name="qwen2.5-7b",
    architecture="Qwen2ForCausalLM",  # its q, k and v projections have biases
    model_type="qwen2",
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    context_length=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
SHAPES = {shape.name: shape for shape in (PHI3_MINI, LLAMA3_8B, QWEN25_7B)}


def build_synthetic_model(
    out_dir: Path,
    shape: Shape,
    *,
    device: str = "cpu",
    seed: int = 0,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Build a random-weight ORT-GenAI model of ``shape`` (its own architecture) in ``out_dir``: int4
    for the CPU, or fp16 with paged attention (continuous batching) for CUDA. No checkpoint is written:
    the builder runs on a config and a tokenizer, with weights made in its own process (see
    :mod:`ortfleet.modelbuild.random_weights`). The check that it generates runs only where
    onnxruntime-genai can use the device. Returns the folder's absolute path."""
    if device not in SYNTHETIC_DEVICES:
        raise ValueError(f"synthetic models are built for {' or '.join(SYNTHETIC_DEVICES)}, not {device!r}")

    def build(work: Path, staged: Path) -> None:
        require_modules(*_REQUIRED_MODULES)
        _build(work, staged, shape, device=device, seed=seed, progress=StageProgress(3, enabled=progress))

    fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(shape).items())
    source = f"random weights, seed {seed}, {fields}"
    return install_model(out_dir, build, source=source, recipe=f"{SYNTHETIC_RECIPE}/{device}", force=force)


def _build(
    work: Path, staged: Path, shape: Shape, *, device: str, seed: int, progress: StageProgress
) -> None:
    logger.info("building a random-weight model, %s, for %s", shape.describe(), device)
    hf_dir = work / "hf"
    options = builder_options(device)
    options["runner"] = (RANDOM_WEIGHTS_MODULE, "--seed", str(seed))
    prepare_builder()
    with progress.stage(f"writing a config and a tokenizer ({shape.describe()})"), quiet_transformers():
        _save_config(hf_dir, shape, half=device == "cuda")
    with progress.stage(f"building the {options['precision']} {device} ONNX model from random weights"):
        run_builder(hf_dir, staged, work / "builder-cache", on_output=progress.note, **options)
    with progress.stage("checking that onnxruntime-genai runs it"):
        if can_check(device, staged):
            check_generates(staged)


def _save_config(hf_dir: Path, shape: Shape, *, half: bool) -> None:
    """Write ``shape``'s config.json and a tokenizer sized to its vocabulary into ``hf_dir``: all the
    builder reads from the folder when the weights are made in its process."""
    from transformers import AutoConfig

    tokenizer = byte_pair_tokenizer(shape.vocab_size)
    tokenizer.save_pretrained(hf_dir)
    fields: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "max_position_embeddings": shape.context_length,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rms_norm_eps": shape.rms_norm_eps,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "float16" if half else "float32",  # a full-size model is 7.6 GB in fp16, twice that in fp32
    }
    config = AutoConfig.for_model(shape.model_type, **(fields | dict(shape.config_overrides)))
    config.architectures = [shape.architecture]
    config.save_pretrained(hf_dir)


def byte_pair_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries, built without training: the tiny
    model's special tokens and chat template, the 256 byte symbols, then merges of byte pairs
    (printable ASCII first) and, past the 65,536 pairs, of a pair and a byte, until the vocabulary is
    full. A model's random weights can sample every id, so every id must decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_symbols()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    merges_needed = vocab_size - len(vocab)
    most = len(alphabet) ** 2 + len(alphabet) ** 3
    if not 0 <= merges_needed <= most:
        raise ValueError(f"a byte-pair vocabulary holds {len(vocab)} to {len(vocab) + most} entries")
    merges = list(itertools.islice(_merges(alphabet), merges_needed))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.add_special_tokens(list(SPECIAL_TOKENS))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return chatml_tokenizer(bpe)


def _merges(alphabet: list[str]) -> Iterator[tuple[str, str]]:
    """Every pair of byte symbols, then every pair followed by a byte symbol (three-byte tokens)."""
    pairs = [(a, b) for a in alphabet for b in alphabet]
    yield from pairs
    for a, b in pairs:
        for c in alphabet:
            yield a + b, c


def _byte_symbols() -> list[str]:
    """The ByteLevel pre-tokenizer's symbols for the 256 bytes, printable ASCII first."""
    from tokenizers import pre_tokenizers

    symbols: list[str] = pre_tokenizers.ByteLevel.alphabet()
    printable = ["\u0120", *(chr(code) for code in range(0x21, 0x7F))]  # U+0120 stands for the space
    return [*printable, *sorted(s for s in symbols if s not in printable)]
