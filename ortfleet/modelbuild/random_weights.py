"""The model builder with random weights in place of a checkpoint's: run as
``python -m ortfleet.modelbuild.random_weights --seed N <the builder's arguments>`` on a Hugging Face
folder that holds only config.json and a tokenizer. It runs onnxruntime-genai's own builder (its
``__main__``, in this process) with ``Model.load_weights`` replaced by a model made in memory from the
config, without torch's initialization, and filled with small random values copied from one pre-drawn
block: the cost is memory bandwidth, not random number generation, and no checkpoint is written or read.
A separate process because onnxruntime-genai 0.18 cannot build models in a process that has run one."""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from collections.abc import Sequence
from typing import Any

BUILDER_MODULE = "onnxruntime_genai.models.builder"
RANDOM_BLOCK_VALUES = 1 << 22  # 4 Mi values drawn once, then copied into every tensor
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
    runpy.run_module(BUILDER_MODULE, run_name="__main__", alter_sys=True)


def _replace_load_weights(seed: int) -> None:
    import onnxruntime_genai.models  # noqa: F401  (puts the builder's own packages on sys.path)

    # onnxruntime-genai's builder imports its own package as the top-level `builders` (the one its
    # __main__ uses): patch that module, not a second copy under onnxruntime_genai.models.
    Model = importlib.import_module("builders.base").Model

    def load_weights(self: Any, input_path: str) -> Any:
        layers = self.num_layers if "num_hidden_layers" in self.extra_options else None
        return random_model(self.model_name_or_path, seed=seed, num_layers=layers)

    Model.load_weights = load_weights


def random_model(model_dir: str, *, seed: int, num_layers: int | None = None) -> Any:
    """The causal LM that ``model_dir``'s config.json describes, in the config's dtype, with random
    weights: built without initialization, then filled by :func:`fill_randomly`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(model_dir)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    print(f"Making random weights ({config.architectures[0]}, {config.dtype}, seed {seed})", flush=True)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)  # type: ignore[no-untyped-call]
    fill_randomly(model, seed=seed)
    return model.eval()


def fill_randomly(model: Any, *, seed: int) -> None:
    """Give every weight of ``model`` values of a normal(0, 0.02) block drawn once, each tensor from a
    random offset into it. Norms keep what their constructor gave them (the identity scale: ones, or
    zeros where the model adds one, as Gemma does); one that torch initializes is reset."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    filled: set[int] = set()  # tied weights (an embedding shared with the LM head) are filled once
    blocks: dict[torch.dtype, torch.Tensor] = {}
    draws = torch.randn(RANDOM_BLOCK_VALUES, generator=generator) * WEIGHT_SCALE
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
                filled.update(p.data_ptr() for p in module.parameters(recurse=False))
                continue
            for parameter in module.parameters(recurse=False):
                if parameter.data_ptr() in filled:
                    continue
                filled.add(parameter.data_ptr())
                block = blocks.setdefault(parameter.dtype, draws.to(parameter.dtype))
                start = int(torch.randint(RANDOM_BLOCK_VALUES, (1,), generator=generator))
                _copy_repeating(parameter.data.view(-1), block, start)


def _copy_repeating(target: Any, block: Any, start: int) -> None:
    """Fill the flat tensor ``target`` with ``block`` from ``start`` on, wrapping around."""
    position, size = 0, target.numel()
    while position < size:
        take = min(size - position, block.numel() - start)
        target[position : position + take].copy_(block[start : start + take])
        position += take
        start = 0


if __name__ == "__main__":
    main()
