"""The model builder with random weights in place of a checkpoint's: run as
``python -m ortfleet.modelbuild.random_weights --seed N <the builder's arguments>`` on a Hugging Face
folder that holds only config.json and a tokenizer. It runs onnxruntime-genai's own builder (its
``__main__``, in this process) with ``Model.load_weights`` replaced by a model made in memory from the
config, without torch's initialization, whose weights are views into one pre-drawn block of small random
values: no random number generation per weight, no memory of their own, and no checkpoint written or
read.
A separate process because onnxruntime-genai 0.18 cannot build models in a process that has run one."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

BUILDER_MODULE = "onnxruntime_genai.models.builder"
# 64 Mi values drawn once, which every weight is a view of: it holds every projection of the shapes in
# synthetic.py but Qwen2.5-7B's MLP (those and the embeddings read it at a row stride)
RANDOM_BLOCK_VALUES = 1 << 26
WEIGHT_SCALE = 0.02  # a normal(0, 0.02) weight keeps activations far from fp16's limits


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name if __spec__ else __name__}",
        description="Run onnxruntime-genai's model builder on random weights made from the input "
        "folder's config.json; every other argument goes to the builder.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    ours, builder_argv = parser.parse_known_args(argv)
    _replace_load_weights(ours.seed)
    sys.argv = [BUILDER_MODULE, *builder_argv]
    # For the whole build: the builder splits fused projections (Phi-3's qkv and gate_up) into new
    # nn.Linear layers whose initialization it overwrites at once, 10 s of a 4-layer Phi-3 build.
    with _without_layer_resets():
        runpy.run_module(BUILDER_MODULE, run_name="__main__", alter_sys=True)


def _replace_load_weights(seed: int) -> None:
    import onnxruntime_genai.models  # noqa: F401  (puts the builder's own packages on sys.path)

    # onnxruntime-genai's builder imports its `builders` package by that top-level name, so the class
    # to patch is that module's, not onnxruntime_genai.models.builders.base's (a second copy).
    Model = importlib.import_module("builders.base").Model

    def load_weights(self: Any, input_path: str) -> Any:
        layers = self.num_layers if "num_hidden_layers" in self.extra_options else None
        return random_model(self.model_name_or_path, seed=seed, num_layers=layers)

    Model.load_weights = load_weights


def random_model(model_dir: str, *, seed: int, num_layers: int | None = None) -> Any:
    """The causal LM that ``model_dir``'s config.json describes, in the config's dtype, with random
    weights: built without initialization, then given values by :func:`fill_randomly`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(model_dir)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    print(f"Making random weights ({config.architectures[0]}, {config.dtype}, seed {seed})", flush=True)
    with _without_layer_resets(), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)  # type: ignore[no-untyped-call]
    fill_randomly(model, seed=seed)
    return model.eval()


@contextlib.contextmanager
def _without_layer_resets() -> Iterator[None]:
    """Linear and embedding layers made meanwhile keep the memory torch.empty gave them (untouched, so
    never paged in): transformers' ``no_init_weights`` alone does not stop ``from_config`` from
    initializing them (its guarded init functions replace the no-ops)."""
    import torch

    resets: dict[Any, Any] = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in resets:
            cls.reset_parameters = _no_reset
        yield
    finally:
        for cls, reset in resets.items():
            cls.reset_parameters = reset


def _no_reset(module: Any) -> None:
    return None


def fill_randomly(model: Any, *, seed: int, block_values: int = RANDOM_BLOCK_VALUES) -> None:
    """Give every weight of ``model`` values from one block of normal(0, 0.02) values drawn once: each
    weight becomes a view into the block at a seeded offset (no copy, so a 7.6 GB model costs no
    memory of its own); a weight larger than the block takes its rows at a stride, overlapping. A
    linear layer's [out, in] weight is the transpose of a contiguous [in, out] view: the builder's
    ONNX MatMul takes it transposed, which is then no copy either.
    Norms keep what their constructor gave them (the identity scale: ones, or zeros where the model adds
    one, as Gemma does); one that torch initializes is reset."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    draws = torch.randn(block_values, generator=generator) * WEIGHT_SCALE
    blocks: dict[torch.dtype, torch.Tensor] = {}
    done: set[int] = set()  # tied weights (an embedding shared with the LM head) are given values once
    with torch.no_grad():
        for module in model.modules():
            norm = "Norm" in type(module).__name__
            reset = getattr(module, "reset_parameters", None)
            if norm and callable(reset):
                reset()
            for name, parameter in module.named_parameters(recurse=False):
                if norm or id(parameter) in done:
                    continue
                done.add(id(parameter))
                if parameter.dtype not in blocks:
                    blocks[parameter.dtype] = draws.to(parameter.dtype)
                block = blocks[parameter.dtype]
                offset = int(torch.randint(block_values, (1,), generator=generator))
                if isinstance(module, torch.nn.Linear) and name == "weight":
                    parameter.data = block_view(block, tuple(parameter.shape[::-1]), offset).T
                else:
                    parameter.data = block_view(block, tuple(parameter.shape), offset)


def block_view(block: Any, shape: tuple[int, ...], offset: int) -> Any:
    """A tensor of ``shape`` that reads ``block`` (1-D) from about ``offset``: contiguous where it fits,
    else its first dimension strided as widely as the block allows (the rows overlap)."""
    import torch

    size, available = math.prod(shape), block.numel()
    if size <= available:
        start = offset % (available - size + 1)
        return block[start : start + size].view(shape)
    rows, row_size = shape[0], size // shape[0]
    if row_size > available:
        raise ValueError(f"a weight of shape {shape} has rows longer than the {available}-value block")
    row_stride = (available - row_size) // (rows - 1)
    start = offset % (available - (rows - 1) * row_stride - row_size + 1)
    inner_strides = torch.empty(shape[1:], device="meta").stride()
    return block.as_strided(shape, (row_stride, *inner_strides), start)


if __name__ == "__main__":
    main()
