"""The CUDA paged graph rewritten for LoRA adapters (paged/model.py over batcher/lora_graph.py), checked
without a card: the tiny model built for CUDA (fp16, paged attention) on the CPU, rewritten for three
adapters. onnxruntime resolves the whole rewritten graph, its contrib operators' types included, and stops
only at the kernel the CPU lacks (PagedAttention); each projection's rewrite is a valid ONNX graph whose
shape inference gives fp16 [tokens, ...] throughout; and it computes, on the CPU, each packed token's
projection with its own row's adapter (a scale per token). On a card: tests/test_gpu_paged_engine.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortfleet.modelbuild.own_model import convert_own_model
from tests.test_lora import write_adapter
from tests.test_model_convert import write_checkpoint
from worker.engines.batcher.adapter_library import AdapterLibrary
from worker.engines.batcher.lora import read_adapter
from worker.engines.batcher.lora_graph import ROW_SCALE, LoraGraph, Projection
from worker.engines.paged.model import paged_session

RANKS = {"first": 2, "second": 4, "third": 8}


@pytest.fixture(scope="module")
def cuda_paged_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama built for CUDA with paged attention: built here, never run here."""
    sources = tmp_path_factory.mktemp("sources")
    checkpoint = write_checkpoint(sources / "Own-Llama")
    return convert_own_model(checkpoint, tmp_path_factory.mktemp("cache"), device="cuda", progress=False)


@pytest.fixture(scope="module")
def adapters(cuda_paged_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: write_adapter(folder / name, cuda_paged_model, seed=seed, rank=rank, strength=2.0)
        for seed, (name, rank) in enumerate(RANKS.items(), start=1)
    }


def dims(info: Any) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]


def test_the_rewritten_cuda_paged_graph_resolves_and_lacks_only_the_cards_paged_attention(
    cuda_paged_model: Path, adapters: dict[str, Path]
) -> None:
    library = AdapterLibrary(cuda_paged_model, adapters)
    graph = library.rewritten()
    assert graph is not None
    model = onnx.load_from_string(graph)
    inputs = {i.name: i for i in model.graph.input}
    assert inputs[ROW_SCALE].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert dims(inputs[ROW_SCALE]) == ["num_tokens", "lora_rank"]  # packed tokens: a scale each
    layouts = library.layouts()
    assert layouts is not None and layouts.every is not None
    for name, value in layouts.every.values.items():  # the weights the runner binds fit the graph's inputs
        assert value.data_type() == "tensor(float16)", name
        declared = dims(inputs[name])
        assert all(d == v for d, v in zip(declared, value.shape(), strict=True) if isinstance(d, int)), name
    assert layouts.every.token_scale(["first", None, "third"], [3, 1, 2]).shape == (6, sum(RANKS.values()))
    assert layouts.every.token_scale(["first"], [1]).dtype == np.float16

    # The runner's own session (paged_session, with the folder's weights); the CPU falls back from CUDA
    for opened in (None, graph):
        with pytest.raises(Exception, match=r"NOT_IMPLEMENTED.*PagedAttention"):
            paged_session(cuda_paged_model, 0, opened)

    wrong = onnx.load_from_string(graph)  # the control: a rewrite whose types do not match is refused
    next(i for i in wrong.graph.input if i.name.endswith(".a")).type.tensor_type.elem_type = TensorProto.FLOAT
    with pytest.raises(Exception, match=r"(?i)type"):
        paged_session(cuda_paged_model, 0, wrong.SerializeToString())


def projection_graph(model: Any, projection: Projection, weight: str) -> Any:
    """One projection's nodes as the rewrite left them (its MatMul, the LoRA delta, the Add and the scale's
    tiling), with its input and weight as the graph's inputs: fp16 [num_tokens, in] and [in, out]."""
    prefix = projection.node
    nodes = [n for n in model.graph.node if n.name == prefix or n.output[0].startswith(f"{prefix}/lora")]
    add = next(n for n in model.graph.node if n.op_type == "Add" and f"{prefix}/lora/delta" in n.input)
    tiling = [n for n in model.graph.node if n.op_type == "Concat" and n.output[0].startswith(ROW_SCALE)]
    inputs = {i.name: i for i in model.graph.input}
    x = nodes[0].input[0]
    graph = helper.make_graph(
        [*tiling, *nodes, add],
        "projection",
        [
            helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["num_tokens", projection.in_features]),
            helper.make_tensor_value_info(
                weight, TensorProto.FLOAT16, [projection.in_features, projection.out_features]
            ),
            inputs[ROW_SCALE],
            inputs[projection.a_input],
            inputs[projection.b_input],
        ],
        [  # what the projection's consumers read: strict inference refuses another shape or type
            helper.make_tensor_value_info(
                add.output[0], TensorProto.FLOAT16, ["num_tokens", projection.out_features]
            )
        ],
    )
    sub = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sub.ir_version = 8
    return sub


def test_each_rewritten_projection_gives_every_packed_token_its_own_rows_adapter_in_fp16(
    cuda_paged_model: Path, adapters: dict[str, Path]
) -> None:
    library = AdapterLibrary(cuda_paged_model, adapters)
    graph = library.rewritten()
    layouts = library.layouts()
    assert graph is not None and layouts is not None and layouts.every is not None
    model = onnx.load_from_string(graph)
    lora = LoraGraph(cuda_paged_model)
    read = {name: read_adapter(name, folder, lora) for name, folder in adapters.items()}
    columns = layouts.every
    rows, tokens = ["first", None, "third", "second", "first"], [3, 1, 2, 1, 4]  # prompt chunks and decodes
    rng = np.random.default_rng(0)
    checked = set()
    for projection in library.projections:
        weight = next(n for n in model.graph.node if n.name == projection.node).input[1]
        sub = projection_graph(model, projection, weight)
        onnx.checker.check_model(sub, full_check=True)
        inferred = onnx.shape_inference.infer_shapes(sub, strict_mode=True)
        values = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
        delta = values[f"{projection.node}/lora/delta"]
        out = inferred.graph.output[0]
        for info in (delta, out):
            assert info.type.tensor_type.elem_type == TensorProto.FLOAT16
            assert dims(info) == ["num_tokens", projection.out_features]

        x = rng.standard_normal((sum(tokens), projection.in_features)).astype(np.float16)
        w = (rng.standard_normal((projection.in_features, projection.out_features)) / 8).astype(np.float16)
        feeds = {sub.graph.input[0].name: x, weight: w, ROW_SCALE: columns.token_scale(rows, tokens)}
        feeds |= {name: columns.values[name].numpy() for name in (projection.a_input, projection.b_input)}
        [y] = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )

        expected = x.astype(np.float32) @ w.astype(np.float32)
        token_rows = np.repeat(np.arange(len(rows)), tokens)
        for token, row in enumerate(token_rows):
            name = rows[row]
            if name is None:
                continue
            for part in projection.parts:
                a, b = read[name].modules[projection.layer, part.module]  # A [r, in], scale B [out, r]
                cut = slice(part.start, part.start + part.width)
                expected[token, cut] += x[token].astype(np.float32) @ a.T @ b.T
        assert np.allclose(y.astype(np.float32), expected, atol=0.05, rtol=0.02)
        plain = x.astype(np.float32) @ w.astype(np.float32)
        first = token_rows == 0
        assert not np.allclose(y[first].astype(np.float32), plain[first], atol=0.05, rtol=0.02)  # it did add
        checked.add(projection.name)
    assert checked == {"qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
