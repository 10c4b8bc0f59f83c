"""LoRA adapters for the batcher: PEFT's adapter folders read and checked against the base model's graph,
and the arrays the rewritten graph (lora_graph.py) takes.

A folder holds `adapter_config.json` and `adapter_model.safetensors`, as PEFT's `save_pretrained` writes
them: for each target module `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. A module's delta is scale x B A, scale alpha / r (alpha / sqrt(r) with
`use_rslora`), alpha and r the module's own where `alpha_pattern` or `rank_pattern` name it. The scale is
folded into B once, so a row's weight in the graph is 1 (a per-request scale could go there).

An adapter that does not fit the base model is refused in one line naming the mismatch: a module the
graph has no projection for, a layer past its last, shapes other than the projection's, or a PEFT
feature other than plain LoRA on linear layers (DoRA, biases, modules_to_save, embeddings).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.lora_graph import LoraGraph, Projection

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?(.*?)\.lora_(A|B)(?:\.[\w-]+)?\.weight")
_MODULE = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class AdapterMismatch(ValueError):
    """The adapter cannot run on this base model; the message names why."""


class AdapterUnreadable(ValueError):
    """The adapter's folder or files cannot be read."""


@dataclass(frozen=True)
class Adapter:
    name: str
    rank: int  # the graph columns it takes: its largest module rank
    modules: dict[
        tuple[int, str], tuple[np.ndarray, np.ndarray]
    ]  # (layer, module): A [r, in], scale B [out, r]


def read_adapter(name: str, folder: Path, graph: LoraGraph) -> Adapter:
    """The PEFT adapter in `folder`, checked against `graph`'s projections (AdapterMismatch if it does not
    fit, AdapterUnreadable if its files cannot be read: the message names why, never their contents)."""

    def refuse(why: str) -> AdapterMismatch:
        return AdapterMismatch(f"the adapter {name!r} ({folder}) does not fit the base model: {why}")

    unreadable = f"the adapter {name!r} cannot be read from {folder}"
    try:
        config = json.loads((folder / CONFIG).read_text())
        tensors = read_safetensors(folder / WEIGHTS)
    except OSError as e:  # its reason and the file's name, never the file's contents
        file = f" ({Path(e.filename).name})" if e.filename else ""
        raise AdapterUnreadable(f"{unreadable}: {e.strerror or type(e).__name__}{file}") from e
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, struct.error) as e:
        raise AdapterUnreadable(
            f"{unreadable}: {CONFIG} is not a JSON object or {WEIGHTS} not a safetensors file"
        ) from e
    except ValueError as e:  # read_safetensors's own
        raise AdapterUnreadable(f"{unreadable}: {e}") from e
    if not isinstance(config, dict):
        raise AdapterUnreadable(f"{unreadable}: {CONFIG} is not a JSON object")
    _check_features(config, refuse)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise refuse(f"it holds {key}, which is not a LoRA A or B weight of a linear layer")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:
        raise refuse(f"{WEIGHTS} holds no LoRA weight")
    modules = {}
    for module, pair in sorted(pairs.items()):
        found = _MODULE.fullmatch(module)
        if found is None:
            raise refuse(f"it targets {module}, which is not a projection of a decoder layer")
        layer, target = int(found[1]), found[2]
        if layer >= graph.layers:
            raise refuse(f"it targets layer {layer}; the base model has {graph.layers} layers")
        place = graph.targets.get((layer, target))
        if place is None:
            known = sorted({m for _, m in graph.targets})
            raise refuse(f"it targets {target}, which the base model's graph has no projection for ({known})")
        if "A" not in pair or "B" not in pair:
            raise refuse(f"{module} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"], pair["B"]
        projection, part = place
        expected_a = (a.shape[0], projection.in_features) if a.ndim == 2 else None
        expected_b = (part.width, a.shape[0]) if a.ndim == 2 else None
        if a.shape != expected_a or b.shape != expected_b:
            raise refuse(
                f"{module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the base model's {target} "
                f"takes {projection.in_features} inputs and gives {part.width} outputs, so they must be "
                f"[r, {projection.in_features}] and [{part.width}, r]"
            )
        rank = a.shape[0]
        alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[layer, target] = (np.ascontiguousarray(a, np.float32), np.asarray(b * scale, np.float32))
    return Adapter(name, max(a.shape[0] for a, _ in modules.values()), modules)


def _check_features(config: Mapping[str, Any], refuse: Any) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise refuse(f"it is a {peft_type} adapter; only LoRA adapters are served")
    unsupported = [
        ("use_dora", "DoRA (use_dora)"),
        ("modules_to_save", "modules_to_save (whole layers trained with it)"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"),
        ("lora_bias", "LoRA biases (lora_bias)"),
        ("trainable_token_indices", "trainable tokens"),
    ]
    for key, what in unsupported:
        if config.get(key):
            raise refuse(f"it uses {what}, which the batcher does not serve")
    if config.get("bias", "none") != "none":
        raise refuse(f"it trains biases (bias {config['bias']!r}); only bias 'none' is served")
    targets = config.get("target_modules") or []
    for embedding in ("embed_tokens", "lm_head", "wte"):
        if embedding in (targets if isinstance(targets, list) else [targets]):
            raise refuse(f"it targets {embedding}; adapters on embeddings are not served")


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value a PEFT pattern map (alpha_pattern) gives the module: its first key that matches the
    module's name or a dotted suffix of it."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key.lstrip('^')})", module):
            return value
    return default


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (an 8-byte little-endian header length, a JSON header, the
    data), as numpy arrays; bfloat16 ones widened to float32."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path.name} is not a safetensors file")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{key} is {entry['dtype']}; adapters in float32, float16 or bfloat16 are read")
        start, stop = entry["data_offsets"]
        array = np.frombuffer(
            data, dtype, offset=8 + size + start, count=(stop - start) // np.dtype(dtype).itemsize
        )
        if entry["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[key] = array.reshape(entry["shape"])
    return tensors


class Columns:
    """Some of the loaded adapters laid out in the graph's inputs: each in the same columns of every
    projection (its offset, its rank wide), and the A and B inputs built from them, on `device` (the
    paged engine's card: an OrtValue's device name and id), fp16 for an fp16 graph's projections."""

    def __init__(
        self,
        projections: Sequence[Projection],
        adapters: Sequence[Adapter],
        device: tuple[str, int] = ("cpu", 0),
    ) -> None:
        self.dtype = np.float16 if any(p.half for p in projections) else np.float32  # the scale's
        self.offsets: dict[str, int] = {}
        self.ranks: dict[str, int] = {}
        columns = 0
        for adapter in adapters:
            self.offsets[adapter.name], self.ranks[adapter.name] = columns, adapter.rank
            columns += adapter.rank
        # No adapter: one zero column (a delta of exactly 0), not none: int8's quantizer makes NaN of an
        # empty tensor.
        self.columns = columns = columns or 1
        self.values: dict[str, ort.OrtValue] = {}
        for p in projections:
            parts = len(p.parts)
            a = np.zeros((p.in_features, parts * columns), np.float32)
            b = np.zeros((parts * columns, p.out_features), np.float32)
            for adapter in adapters:
                offset = self.offsets[adapter.name]
                for index, part in enumerate(p.parts):
                    weights = adapter.modules.get((p.layer, part.module))
                    if weights is None:
                        continue
                    lora_a, lora_b = weights
                    first = index * columns + offset
                    a[:, first : first + len(lora_a)] = lora_a.T
                    b[first : first + len(lora_a), part.start : part.start + part.width] = lora_b.T
            if p.quantized:
                a, a_scale, b = _int8(a, b)
                self.values[p.a_scale_input] = ort.OrtValue.ortvalue_from_numpy(a_scale, *device)
            elif p.half:
                a, b = a.astype(np.float16), b.astype(np.float16)
            self.values[p.a_input] = ort.OrtValue.ortvalue_from_numpy(a, *device)
            self.values[p.b_input] = ort.OrtValue.ortvalue_from_numpy(b, *device)

    def bind(self, binding: ort.IOBinding) -> None:
        """Binds its A and B inputs (each where its OrtValue sits) to a run's binding; the run's scale
        (row_scale, token_scale) is the caller's to bind."""
        for name, weights in self.values.items():
            binding.bind_ortvalue_input(name, weights)

    def row_scale(self, rows: Sequence[str | None]) -> np.ndarray:
        """The run's row_scale [rows, 1, columns]: 1 in each row's adapter's columns (None: the base
        model, all 0)."""
        scale = np.zeros((len(rows), 1, self.columns), self.dtype)
        for row, name in enumerate(rows):
            if name is not None:
                offset = self.offsets[name]
                scale[row, 0, offset : offset + self.ranks[name]] = 1.0
        return scale

    def token_scale(self, rows: Sequence[str | None], tokens: Sequence[int]) -> np.ndarray:
        """The scale of a run of packed rows (the paged CUDA graph's) [tokens, columns]: each row's
        `tokens` new tokens get its row_scale."""
        return np.repeat(self.row_scale(rows)[:, 0], tokens, axis=0)


def _int8(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [in, columns] and B [columns, out] in int8 for DynamicQuantizeMatMul: each B row scaled to
    [-127, 127] on its own (an adapter's precision does not depend on the others'), its scale moved
    into A's column, and A quantized per column (A's int8 values and their scales, B's int8 values)."""
    rows = np.abs(b).max(axis=1) / 127
    rows[rows == 0] = 1
    a = a * rows
    columns = np.abs(a).max(axis=0) / 127
    columns[columns == 0] = 1
    quantized_a = np.round(a / columns).astype(np.int8)
    quantized_b = np.round(b / rows[:, None]).astype(np.int8)
    return quantized_a, columns.astype(np.float32), quantized_b


class AdapterSet:
    """The loaded adapters, in three layouts: none (a run of base-model rows computes no LoRA columns),
    each one alone (a prefill, or a decode run whose adapter rows all use it: its rank's columns only),
    and all of them (any other run). A run's LoRA work is its adapters' columns, not every adapter's,
    for twice the adapters' memory."""

    def __init__(
        self,
        projections: Sequence[Projection],
        adapters: Sequence[Adapter],
        device: tuple[str, int] = ("cpu", 0),
    ) -> None:
        self.none = Columns(projections, [], device)
        self.alone = {adapter.name: Columns(projections, [adapter], device) for adapter in adapters}
        self.every = Columns(projections, adapters, device) if len(adapters) > 1 else None

    @property
    def names(self) -> list[str]:
        return list(self.alone)

    def layout(self, rows: Sequence[str | None]) -> Columns:
        """The layout a run of these rows' adapters (None: the base model) takes."""
        used = {name for name in rows if name is not None}
        if not used:
            return self.none
        if len(used) == 1:
            return self.alone[used.pop()]
        assert self.every is not None
        return self.every
