"""The decoder graph rewritten once per session so that each row of a run may use its own LoRA adapter.

ORT-GenAI's builder writes each layer's projections as one node named `/model/layers.{i}/attn|mlp/
{projection}/MatMul` (fp32) or `.../MatMul_Q4` (MatMulNBits, int4), q, k and v packed into one `qkv_proj`
whose output columns are q | k | v. To each projection `y = x W` the rewrite adds

    y += ((x @ A) * row_scale) @ B

where A [in, parts x R] holds every loaded adapter's A^T for the projection's sub-projections (a packed
qkv has three parts), B [parts x R, out] their scaled B^T, block-diagonal over the parts, and
`row_scale` [batch, 1, R] is one input for the whole run: each row's weight in its adapter's R columns and
0 elsewhere (a base-model row: all zeros), tiled once per part count. Every adapter takes the same R
columns in every projection (lora.py's AdapterSet), so a run costs one small input beyond today's; A and B
are inputs too, bound once per binding, so adapters can change without a new session.

On an int4 graph (MatMulNBits) the two products are DynamicQuantizeMatMul with int8 A and B (lora.py's
_int8): LoRA weights in fp32 cost a run as many bytes as the int4 model's own (3 adapters of rank 16 on
every projection of SmolLM2-135M), and int8 products ran 3x faster than fp32 MatMul at these shapes. It
quantizes a run's activations as one tensor, so an adapter row's rounding depends on the run's other rows
(a base-model row's delta stays exactly 0). An fp32 graph keeps fp32 products, equal to merged weights.

The paged engine's graphs take the same rewrite. On the CUDA paged graph (paged/model.py) a run's tokens
are packed, one row after another ([tokens, hidden], no batch axis), so `row_scale` is [tokens, R]: each
token gets its row's scale (lora.py's Columns.token_scale). An fp16 graph (the CUDA builds) takes A, B and
the scale in fp16, its products plain fp16 MatMul on the card, MatMulNBits projections included.

Only the projections some loaded adapter targets are rewritten. The graph's other nodes are untouched: a
projection's node writes to a renamed output, and the Add that sums it with the delta writes the name its
consumers read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.engines.genai_config import read_genai

ROW_SCALE = "lora_row_scale"
_NODE = re.compile(r"/model/layers\.(\d+)/(?:attn|mlp)/(\w+)/MatMul(?:_Q\d+)?")
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SINGLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FLOAT, _INT8, _FLOAT16 = 1, 3, 10  # onnx.TensorProto's


class LoraGraphError(ValueError):
    """The base model's graph cannot take adapters (its projections are not the builder's)."""


@dataclass(frozen=True)
class Part:
    """A sub-projection of a projection node: a PEFT target module and its output columns."""

    module: str
    start: int
    width: int


@dataclass(frozen=True)
class Projection:
    layer: int
    name: str  # as the graph names it: qkv_proj, o_proj, ...
    node: str
    in_features: int
    out_features: int
    parts: tuple[Part, ...]
    quantized: bool  # a MatMulNBits node: its adapters' weights run in int8 (see the module's docstring)
    half: bool = False  # the graph's activations are fp16: its adapters' weights are too

    @property
    def a_input(self) -> str:
        return f"lora.layers.{self.layer}.{self.name}.a"

    @property
    def a_scale_input(self) -> str:
        return f"lora.layers.{self.layer}.{self.name}.a_scale"

    @property
    def b_input(self) -> str:
        return f"lora.layers.{self.layer}.{self.name}.b"


class LoraGraph:
    """The folder's decoder graph (its external weights left on disk) and the projections an adapter may
    target: `targets[(layer, module)]` is the projection and the part a PEFT module's weights go to."""

    def __init__(self, model_dir: Path) -> None:
        import onnx

        decoder = read_genai(model_dir)["model"]["decoder"]
        self.model_dir = model_dir
        self.model: Any = onnx.load(str(model_dir / decoder["filename"]), load_external_data=False)
        self.layers: int = decoder["num_hidden_layers"]
        q = decoder["num_attention_heads"] * decoder["head_size"]
        kv = decoder["num_key_value_heads"] * decoder["head_size"]
        logits = next(o for o in self.model.graph.output if o.name == "logits")
        element = logits.type.tensor_type.elem_type
        if element not in (_FLOAT, _FLOAT16):
            raise LoraGraphError(
                "adapters need a graph whose activations are float32 (an fp32 or int4 CPU build) or "
                "float16 (a CUDA build)"
            )
        self.half = element == _FLOAT16
        input_ids = next(i for i in self.model.graph.input if i.name == "input_ids")
        # the paged CUDA graph's tokens are packed [tokens]: a scale per token, not per batch row
        self.packed_tokens = len(input_ids.type.tensor_type.shape.dim) == 1
        self.projections = _projections(self.model.graph, q, kv, self.half)
        if not self.projections:
            raise LoraGraphError("the graph has no projection node an adapter could target")
        self.targets: dict[tuple[int, str], tuple[Projection, Part]] = {
            (p.layer, part.module): (p, part) for p in self.projections for part in p.parts
        }

    def rewritten(self, projections: list[Projection]) -> bytes:
        """The graph with these projections' LoRA deltas added (see the module's docstring), serialized.
        The rewrite is made on a copy: the graph read once serves every rewrite (at start and at each load
        that needs a new session)."""
        from onnx import helper, numpy_helper

        model = type(self.model)()
        model.CopyFrom(self.model)  # the graph's structure only: its weights stay on disk
        graph = model.graph
        nodes = {node.name: node for node in graph.node}
        tiled: dict[int, str] = {1: ROW_SCALE}
        added = []
        element = _FLOAT16 if self.half else _FLOAT
        scale_shape: list[str | int] = (
            ["num_tokens", "lora_rank"] if self.packed_tokens else ["batch_size", 1, "lora_rank"]
        )
        inputs = [helper.make_tensor_value_info(ROW_SCALE, element, scale_shape)]
        for p in projections:
            node = nodes[p.node]
            parts = len(p.parts)
            if parts not in tiled:
                tiled[parts] = f"{ROW_SCALE}/x{parts}"
                added.append(helper.make_node("Concat", [ROW_SCALE] * parts, [tiled[parts]], axis=-1))
            columns = f"lora_rank_x{parts}"
            kind = _INT8 if p.quantized else element
            inputs.append(helper.make_tensor_value_info(p.a_input, kind, [p.in_features, columns]))
            inputs.append(helper.make_tensor_value_info(p.b_input, kind, [columns, p.out_features]))
            out = node.output[0]
            base = f"{p.node}/lora/base"
            node.output[0] = base
            for info in graph.value_info:
                if info.name == out:
                    info.name = base
            prefix = f"{p.node}/lora"
            if p.quantized:
                inputs.append(helper.make_tensor_value_info(p.a_scale_input, _FLOAT, [columns]))
                ones = f"{prefix}/b_scale"
                graph.initializer.append(numpy_helper.from_array(np.ones(p.out_features, np.float32), ones))
                down = _node(helper, "DynamicQuantizeMatMul", [node.input[0], p.a_input, p.a_scale_input])
                up = _node(helper, "DynamicQuantizeMatMul", [f"{prefix}/scaled", p.b_input, ones])
            else:
                down = _node(helper, "MatMul", [node.input[0], p.a_input])
                up = _node(helper, "MatMul", [f"{prefix}/scaled", p.b_input])
            down.output.append(f"{prefix}/down")
            up.output.append(f"{prefix}/delta")
            added += [
                down,
                helper.make_node("Mul", [f"{prefix}/down", tiled[parts]], [f"{prefix}/scaled"]),
                up,
                helper.make_node("Add", [base, f"{prefix}/delta"], [out]),
            ]
        graph.node.extend(added)
        graph.input.extend(inputs)
        if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        data: bytes = model.SerializeToString()
        return data


def _node(helper: Any, op: str, inputs: list[str]) -> Any:
    domain = "com.microsoft" if op == "DynamicQuantizeMatMul" else ""
    return helper.make_node(op, inputs, [], domain=domain)


def _projections(graph: Any, q: int, kv: int, half: bool) -> list[Projection]:
    from onnx import helper

    dims = {init.name: list(init.dims) for init in graph.initializer}
    found = []
    for node in graph.node:
        match = _NODE.fullmatch(node.name)
        if match is None or node.op_type not in ("MatMul", "MatMulNBits"):
            continue
        layer, name = int(match[1]), match[2]
        if node.op_type == "MatMulNBits":
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            in_features, out_features = int(attributes["K"]), int(attributes["N"])
        elif len(dims.get(node.input[1], ())) == 2:
            in_features, out_features = dims[node.input[1]]
        else:
            continue
        widths: tuple[int, ...]
        if name == "qkv_proj":
            widths = (q, kv, kv)
            if sum(widths) != out_features:
                raise LoraGraphError(f"{node.name} has {out_features} outputs, not q {q} + k {kv} + v {kv}")
        elif name in _PACKED:
            widths = (out_features // 2,) * 2
        elif name in _SINGLE:
            widths = (out_features,)
        else:
            continue
        modules = _PACKED.get(name, (name,))
        starts = [sum(widths[:i]) for i in range(len(widths))]
        parts = tuple(Part(m, s, w) for m, s, w in zip(modules, starts, widths, strict=True))
        quantized = node.op_type == "MatMulNBits" and not half  # fp16: plain MatMul (the card's)
        found.append(Projection(layer, name, node.name, in_features, out_features, parts, quantized, half))
    return found
