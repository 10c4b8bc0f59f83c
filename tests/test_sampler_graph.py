"""The sampler graph (worker/engines/device_sampling/) on the CPU execution provider against `RowSampler`, the
batcher's per-row sampling, on seeded random logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from worker.engine import GenerationRequest
from worker.engines.batcher.sampler import RowSampler, token_logprobs
from worker.engines.device_sampling.graph import OPSET, TOP_LOGPROBS, sampler_model
from worker.engines.device_sampling.runner import SamplerGraph, Widths

pytestmark = pytest.mark.unit

EOS = frozenset({2, 5})


def random_request(rng: np.random.Generator, vocab: int) -> GenerationRequest:
    kind = rng.integers(6)
    options: dict[str, object] = {"seed": int(rng.integers(2**40))}
    if kind > 0:
        options["temperature"] = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
    if kind in (2, 4):
        options["top_k"] = int(rng.choice([1, 2, 20, 50, 256]))
    if kind in (3, 4):
        options["top_p"] = float(rng.choice([0.1, 0.5, 0.9, 0.95]))
    if rng.random() < 0.4:
        options["repetition_penalty"] = float(rng.choice([0.8, 1.1, 1.3]))
    if rng.random() < 0.4:
        options["presence_penalty"] = float(rng.uniform(-2, 2))
        options["frequency_penalty"] = float(rng.uniform(-2, 2))
    if rng.random() < 0.3:
        ids = rng.choice(vocab, int(rng.integers(1, 20)), replace=False)
        options["logit_bias"] = tuple((int(t), float(rng.uniform(-100, 100))) for t in sorted(ids))
    options["min_new_tokens"] = int(rng.integers(3))
    prompt = [int(t) for t in rng.integers(vocab, size=int(rng.integers(1, 40)))]
    return GenerationRequest(prompt, 100, **options)  # type: ignore[arg-type]


def twin_samplers(
    rng: np.random.Generator, rows: int, vocab: int
) -> tuple[list[RowSampler], list[RowSampler]]:
    """Pairs of samplers in the same state: one for the graph, one that picks on its own."""
    ours, theirs = [], []
    for _ in range(rows):
        request = random_request(rng, vocab)
        pair = [RowSampler(request, EOS, vocab, None) for _ in range(2)]
        for token in rng.integers(vocab, size=int(rng.integers(4))):
            for sampler in pair:
                sampler.accept(int(token))
        ours.append(pair[0])
        theirs.append(pair[1])
    return ours, theirs


def random_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    scale = rng.choice([1.0, 3.0, 6.0, 12.0], size=(rows, 1))
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


def compare_step(
    graph: SamplerGraph,
    rng: np.random.Generator,
    rows: int,
    vocab: int,
    on_card: bool = False,
    element: type | None = None,
) -> int:
    """The graph's step against RowSampler's picks; the rows the graph served. `on_card`: the logits are
    handed to the graph as a CUDA OrtValue, as the model leaves them. `element` (numpy's float16 or
    float32): the rows lie among a run's logits [tokens, vocab] of that type, an OrtValue the graph reads
    with `taken`, and RowSampler picks from the same logits as float32."""
    ours, theirs = twin_samplers(rng, rows, vocab)
    logits = random_logits(rng, rows, vocab)
    produced = [int(p) for p in rng.integers(3, size=rows)]
    device = ("cuda", 0) if on_card else ("cpu", 0)
    if element is None:
        given = ort.OrtValue.ortvalue_from_numpy(logits, *device) if on_card else logits
        step = graph.run(given, ours, produced)
    else:
        logits = logits.astype(element).astype(np.float32)  # the model's values, as the graph reads them
        run, taken = run_logits(rng, logits, element)
        step = graph.run(ort.OrtValue.ortvalue_from_numpy(run, *device), ours, produced, taken)
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        expected = reference.choose(logits[index].copy(), produced[index])
        if step.host[index]:  # the host path draws with the uniform the graph was given
            assert mine.choose(logits[index].copy(), produced[index]) == expected
            continue
        assert step.tokens[index] == expected, index
        found = token_logprobs(logits[index], expected, TOP_LOGPROBS)
        assert abs(step.logprobs[index] - found.logprob) < 1e-4
        likeliest = np.argsort(-logits[index], kind="stable")[:TOP_LOGPROBS]  # ties: the lower id first
        if on_card:  # CUDA's TopK may list equal logits in either order (seen on an H200)
            np.testing.assert_array_equal(logits[index][step.top_ids[index]], logits[index][likeliest])
        else:
            assert step.top_ids[index].tolist() == likeliest.tolist()
        edge = set(np.flatnonzero(logits[index] == logits[index][likeliest[-1]]))
        assert set(step.top_ids[index].tolist()) <= set(likeliest) | edge
        assert {t for t, _ in found.top} <= set(likeliest) | edge
        np.testing.assert_allclose(step.top_logprobs[index], [v for _, v in found.top], atol=1e-4, rtol=0)
        mine.accept(int(step.tokens[index]))
        reference.accept(expected)
        assert mine.uniform() == reference.uniform()  # both generators went on alike
    return int((~step.host).sum())


def run_logits(rng: np.random.Generator, rows: np.ndarray, element: type) -> tuple[np.ndarray, np.ndarray]:
    """A run's logits [tokens, vocab] in `element` holding `rows` at shuffled tokens among others, and the
    tokens that hold them (`taken`), as the paged model returns them."""
    tokens = 2 * len(rows) + 3
    run = random_logits(rng, tokens, rows.shape[1]).astype(element)
    taken = rng.permutation(tokens)[: len(rows)].astype(np.int64)
    run[taken] = rows.astype(element)
    return run, taken


def ten_thousand_rows(providers: tuple[str, ...], on_card: bool) -> None:
    rng = np.random.default_rng(59)
    rows = served = 0
    for vocab, steps, width in (
        (49152, 1, 256),
        (32000, 1, 128),
        (1000, 30, 256),
        (300, 6, 256),
        (40, 8, 64),
    ):
        graph = SamplerGraph(EOS, vocab, providers=providers)
        for _ in range(steps):
            served += compare_step(graph, rng, width, vocab, on_card)
            rows += width
    assert rows >= 10_000
    assert served > 0.8 * rows


def test_the_graph_picks_as_row_sampler_does_over_ten_thousand_rows() -> None:
    ten_thousand_rows(("CPUExecutionProvider",), on_card=False)


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="this onnxruntime has no CUDA provider",
)
def test_on_the_cuda_provider_with_the_logits_on_the_card_the_graph_picks_as_row_sampler_does() -> None:
    ten_thousand_rows(("CUDAExecutionProvider", "CPUExecutionProvider"), on_card=True)


def test_penalties_bias_and_min_tokens_change_the_greedy_pick_as_row_sampler_does() -> None:
    vocab = 12
    logits = np.zeros((4, vocab), np.float32)
    logits[:, 5] = 3.0  # an end of sequence, likeliest
    logits[:, 7] = 2.0
    logits[:, 8] = -1.0
    requests = [
        GenerationRequest([1], 9, min_new_tokens=2),  # eos masked: 7
        GenerationRequest([7], 9, repetition_penalty=2.0),  # 5, and 7 halved
        GenerationRequest([1], 9, logit_bias=((8, 10.0),)),  # 8
        GenerationRequest([1], 9, presence_penalty=1.5, frequency_penalty=1.0),  # 5 counted twice: 7
    ]
    samplers = [RowSampler(r, EOS, vocab, None) for r in requests]
    samplers[3].accept(5)
    samplers[3].accept(5)
    step = SamplerGraph(EOS, vocab).run(logits, samplers, [0, 0, 0, 0])
    expected = [s.choose(row.copy(), 0) for s, row in zip(samplers, logits, strict=True)]
    assert step.tokens.tolist() == expected == [7, 5, 8, 7]
    assert not step.host.any()


def test_rows_past_the_graph_limits_are_flagged_for_the_host_path() -> None:
    vocab = 600
    rng = np.random.default_rng(1)
    flat = np.zeros((1, vocab), np.float32)  # a nucleus of 0.9 is 540 tokens, past 256 candidates
    requests = [
        GenerationRequest(list(range(30)), 9, repetition_penalty=1.2),  # 30 penalized tokens, past 16
        GenerationRequest([1], 9, temperature=1.0, top_k=300, seed=1),  # past 256 candidates
        GenerationRequest([1], 9, temperature=1.0, top_p=0.9, seed=1),
        GenerationRequest([1], 9, temperature=1.0, top_k=3, seed=1),  # three tied tokens
        GenerationRequest([1], 9, temperature=1.0, seed=1),  # the whole vocabulary: served
    ]
    logits = np.repeat(rng.standard_normal((1, vocab)).astype(np.float32), len(requests), axis=0)
    logits[2] = flat
    logits[3, :3] = 50.0
    samplers = [RowSampler(r, EOS, vocab, None) for r in requests]
    step = SamplerGraph(EOS, vocab, widths=Widths(penalized=16)).run(logits, samplers, [0] * len(requests))
    assert step.host.tolist() == [True, True, True, True, False]


def test_onnxruntime_top_k_puts_the_lower_index_first_among_ties() -> None:
    node = helper.make_node("TopK", ["x", "k"], ["values", "ids"], axis=1)
    graph = helper.make_graph(
        [node],
        "ties",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("ids", TensorProto.INT64, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(1, 49152)).astype(np.float32)
    for k in (20, 257, 49152):
        _, ids = session.run(None, {"x": x, "k": np.array([k], np.int64)})
        assert ids[0].tolist() == np.argsort(-x[0], kind="stable")[:k].tolist()
    assert onnx.defs.onnx_opset_version() >= OPSET


def test_the_benchs_profile_gives_each_kind_of_node_its_time_and_provider(tmp_path: Path) -> None:
    from ortfleet.bench.sampler_graph import bench

    figures = bench(8, 300, 1, profile=tmp_path)
    nodes = figures["nodes"]
    assert "TopK" in {n["op"] for n in nodes}
    assert {n["provider"] for n in nodes} == {"CPUExecutionProvider"}
    assert all(n["ms"] >= 0 and n["runs"] >= 1 for n in nodes)
    assert [n["ms"] for n in nodes] == sorted((n["ms"] for n in nodes), reverse=True)


@pytest.mark.parametrize("element", [np.float16, np.float32], ids=["float16", "float32"])
def test_the_graph_reads_a_runs_logits_where_they_lie_and_picks_its_taken_rows_as_row_sampler_does(
    element: type,
) -> None:
    """The graph's other form: the run's logits [tokens, vocab] in the model's type (float16 on a card)
    and the tokens whose rows sample, gathered and cast at its head."""
    rng = np.random.default_rng(61)
    rows = served = 0
    for vocab, steps, width in ((49152, 1, 256), (1000, 8, 256), (40, 4, 64)):
        graph = SamplerGraph(EOS, vocab)
        for _ in range(steps):
            served += compare_step(graph, rng, width, vocab, element=element)
            rows += width
    assert served > 0.8 * rows


def test_on_a_runs_float32_logits_the_gathered_form_gives_the_rows_forms_every_output() -> None:
    rng = np.random.default_rng(67)
    vocab = 3000
    graph = SamplerGraph(EOS, vocab)
    ours, theirs = twin_samplers(rng, 128, vocab)
    logits = random_logits(rng, 128, vocab)
    run, taken = run_logits(rng, logits, np.float32)
    produced = [0] * 128
    gathered = graph.run(ort.OrtValue.ortvalue_from_numpy(run), ours, produced, taken)
    rows = graph.run(logits, theirs, produced)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "host"):
        np.testing.assert_array_equal(getattr(gathered, name), getattr(rows, name), err_msg=name)


@pytest.mark.parametrize("element", [np.float16, np.float32], ids=["float16", "float32"])
def test_the_rows_the_host_reads_come_back_alone_as_float32(element: type) -> None:
    rng = np.random.default_rng(71)
    run = random_logits(rng, 40, 500).astype(element)
    index = np.array([31, 2, 17, 2])
    rows = SamplerGraph(EOS, 500).host_rows(ort.OrtValue.ortvalue_from_numpy(run), index)
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows, run[index].astype(np.float32))


# The CUDA provider's kernels (onnxruntime's docs/OperatorKernels.md, CUDAExecutionProvider, for the
# versions of opset 18): the element types each op takes, of the input that types it (Where's second).
_ALL = {"bool", "double", "float", "float16", "int8", "int16", "int32", "int64", "uint8", "uint32", "uint64"}
_NUMBERS = {"double", "float", "float16", "int32", "int64", "uint32", "uint64"}
CUDA_KERNELS: dict[str, set[str]] = {
    **{op: _ALL for op in ("Cast", "Concat", "Gather", "GatherElements", "ScatterElements", "Slice")},
    **{op: _ALL for op in ("Squeeze", "Unsqueeze", "Identity", "Reshape")},
    **{op: _NUMBERS | {"int8", "int16"} for op in ("Add", "Sub", "Mul", "Div")},
    **{op: _NUMBERS for op in ("Greater", "Less", "LessOrEqual", "GreaterOrEqual", "Min", "CumSum")},
    **{op: {"bool"} for op in ("And", "Or", "Not")},
    "NonZero": {"bool", "float", "float16", "int32", "int64", "uint8"},
    "Equal": _NUMBERS | {"bool"},
    "ReduceMin": {"double", "float", "float16", "int32", "int64", "int8", "uint8"},
    **{op: {"double", "float", "float16"} for op in ("Exp", "Log", "Floor")},
    "Pow": {"double", "float", "float16", "int32", "int64"},
    "LogSoftmax": {"double", "float", "float16"},
    "Neg": {"double", "float", "float16", "int8", "int16", "int32", "int64"},
    "ReduceMax": {"double", "float", "float16", "int32", "int64"},
    "ReduceSum": {"double", "float", "float16", "int32", "int64"},
    "TopK": {"double", "float", "float16", "int32", "int64"},
    "Where": {"double", "float", "float16", "int32", "int64", "uint8"},
}


@pytest.mark.parametrize(
    ("element", "gathered"), [(TensorProto.FLOAT, False), (TensorProto.FLOAT16, True)], ids=["rows", "run"]
)
def test_every_node_of_the_graph_has_a_cuda_kernel_for_its_types_and_none_computes_shapes(
    element: int, gathered: bool
) -> None:
    """So that on the card no node falls back to the CPU provider: none lacks a CUDA kernel, and none
    reads a shape (onnxruntime places shape arithmetic on the CPU provider)."""
    model = onnx.shape_inference.infer_shapes(sampler_model(1000, 256, element, gathered), strict_mode=True)
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        assert node.op_type in CUDA_KERNELS, node.op_type
        typed = node.input[1] if node.op_type == "Where" else node.input[0]
        seen = [typed, node.output[0]] if node.op_type == "Cast" else [typed]
        for name in seen:
            kind = helper.tensor_dtype_to_np_dtype(types[name]).name
            assert (
                kind.replace("float32", "float").replace("float64", "double") in CUDA_KERNELS[node.op_type]
            ), (
                node.op_type,
                kind,
            )


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="this onnxruntime has no CUDA provider",
)
def test_on_the_card_every_node_runs_on_the_cuda_provider_and_picks_from_float16_logits_where_they_lie() -> (
    None
):
    """Without the CPU provider to fall back on, a node with no CUDA kernel fails the session's start."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    rng = np.random.default_rng(73)
    served = rows = 0
    for vocab, steps in ((49152, 2), (1000, 4)):
        graph = SamplerGraph(EOS, vocab, providers=("CUDAExecutionProvider",), options=options)
        for _ in range(steps):
            served += compare_step(graph, rng, 256, vocab, on_card=True, element=np.float16)
            rows += 256
        for kind in ("greedy", "top_k", "temperature"):  # no row drawing over the whole vocabulary, all
            alike_step(graph, kind, vocab, on_card=True)
        run = random_logits(rng, 300, vocab).astype(np.float16)
        index = np.array([7, 299, 0])
        taken = graph.host_rows(ort.OrtValue.ortvalue_from_numpy(run, "cuda", 0), index)
        np.testing.assert_array_equal(taken, run[index].astype(np.float32))
    assert served > 0.8 * rows


def test_a_greedy_row_takes_the_first_of_tied_maxima_as_row_sampler_does() -> None:
    """Ties are common among float16 logits; the graph's greedy pick is the first, whatever the provider's
    ArgMax would do with them."""
    vocab = 700
    logits = np.zeros((3, vocab), np.float32)
    logits[0, [9, 400, 650]] = 4.0
    logits[1, [3, 4]] = -1.0
    logits[1, :3] = logits[1, 5:] = -2.0
    logits[2, [699, 2]] = 1.5  # 2, an end of sequence, masked under min_tokens: 699
    requests = [
        GenerationRequest([1], 9),
        GenerationRequest([1], 9),
        GenerationRequest([1], 9, min_new_tokens=1),
    ]
    samplers = [RowSampler(r, EOS, vocab, None) for r in requests]
    step = SamplerGraph(EOS, vocab).run(logits.astype(np.float16), samplers, [0, 0, 0])
    expected = [s.choose(row.copy(), 0) for s, row in zip(samplers, logits, strict=True)]
    assert step.tokens.tolist() == expected == [9, 3, 699]


def alike_step(graph: SamplerGraph, kind: str, vocab: int, on_card: bool = False) -> None:
    """A step of rows that all pick alike against RowSampler's picks, the logits float16 as a model on a
    card leaves them."""
    rng = np.random.default_rng(79)
    rows = 64
    options: dict[str, Any] = {
        "greedy": {},
        "top_k": {"temperature": 0.9, "top_k": 40},
        "temperature": {"temperature": 0.9},
    }[kind]
    requests = [GenerationRequest([1, 2], 9, seed=row, **options) for row in range(rows)]
    ours = [RowSampler(r, EOS, vocab, None) for r in requests]
    theirs = [RowSampler(r, EOS, vocab, None) for r in requests]
    run = random_logits(rng, rows, vocab).astype(np.float16)
    given = ort.OrtValue.ortvalue_from_numpy(run, *(("cuda", 0) if on_card else ("cpu", 0)))
    step = graph.run(given, ours, [0] * rows, np.arange(rows))
    logits = run.astype(np.float32)
    expected = [s.choose(row.copy(), 0) for s, row in zip(theirs, logits, strict=True)]
    served = ~step.host
    assert served.sum() > rows / 2
    assert step.tokens[served].tolist() == np.array(expected)[served].tolist()


@pytest.mark.parametrize("kind", ["greedy", "top_k", "temperature"])
def test_a_step_whose_rows_all_pick_alike_picks_as_row_sampler_does(kind: str) -> None:
    """Steps with no row drawing over the whole vocabulary, and with every row doing so: the graph takes
    the whole vocabulary's running sum for those rows alone, none or all."""
    alike_step(SamplerGraph(EOS, 3000), kind, 3000)


def whole_vocabulary_step(
    graph: SamplerGraph, rng: np.random.Generator, scales: tuple[float, ...], element: type, on_card: bool
) -> tuple[int, int]:
    """A step of temperature-only rows (each drawing over the whole vocabulary in token order) from a
    run's logits in `element`, against RowSampler's picks: the rows the graph served and those it flagged
    for the host (whose host pick draws with the uniform the graph was given)."""
    rows, vocab = 256, graph.vocab_size
    temperature = rng.choice([0.3, 0.7, 1.0, 1.5], size=rows)
    requests = [
        GenerationRequest([1], 9, temperature=float(t), seed=int(rng.integers(2**40))) for t in temperature
    ]
    ours = [RowSampler(r, EOS, vocab, None) for r in requests]
    theirs = [RowSampler(r, EOS, vocab, None) for r in requests]
    scale = rng.choice(scales, size=(rows, 1))
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(element).astype(np.float32)
    run, taken = run_logits(rng, logits, element)
    device = ("cuda", 0) if on_card else ("cpu", 0)
    step = graph.run(ort.OrtValue.ortvalue_from_numpy(run, *device), ours, [0] * rows, taken)
    for index in range(rows):
        expected = theirs[index].choose(logits[index].copy(), 0)
        picked = ours[index].choose(logits[index].copy(), 0) if step.host[index] else step.tokens[index]
        assert picked == expected, (index, step.host[index])
    return int((~step.host).sum()), int(step.host.sum())


def peaked_and_flat_whole_vocabulary_rows(element: type, on_card: bool) -> dict[str, float]:
    """Thousands of seeded temperature-only rows: peaked softmaxes (logits' spread 8 and 12, as a model's
    usually are) and near-flat ones (1 and 3, many tokens of about equal probability); the share of each
    that the graph flags for the host."""
    rng = np.random.default_rng(83)
    flagged: dict[str, float] = {}
    for name, scales in (("peaked", (8.0, 12.0)), ("flat", (1.0, 3.0))):
        served = hosted = 0
        for vocab, steps in ((49152, 3), (3000, 6)):
            graph = SamplerGraph(EOS, vocab, providers=PROVIDERS[on_card])
            for _ in range(steps):
                more, host = whole_vocabulary_step(graph, rng, scales, element, on_card)
                served, hosted = served + more, hosted + host
        assert served + hosted == 9 * 256
        flagged[name] = hosted / (served + hosted)
    return flagged


PROVIDERS = {False: ("CPUExecutionProvider",), True: ("CUDAExecutionProvider", "CPUExecutionProvider")}


@pytest.mark.parametrize("element", [np.float16, np.float32], ids=["float16", "float32"])
def test_rows_drawing_over_the_whole_vocabulary_pick_as_row_sampler_does_and_peaked_ones_stay_on_the_graph(
    element: type,
) -> None:
    """The graph's two-level running sum (block totals, then inside the draw's block) adds in another order
    than RowSampler's np.cumsum, both in float64, and its softmax differs from numpy's by float32 ulps: a
    row whose draw lands within that slack of a token's edge goes to the host, a few of near-flat rows
    (tokens of about equal probability over tens of thousands), almost none of peaked ones. Every row
    served picks RowSampler's token (whole_vocabulary_step); a float32 running sum in RowSampler, which
    drifts by up to 1e-4 of the total, would make served rows pick elsewhere."""
    flagged = peaked_and_flat_whole_vocabulary_rows(element, on_card=False)
    assert flagged["peaked"] < 0.01
    assert flagged["flat"] < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="this onnxruntime has no CUDA provider",
)
def test_on_the_card_rows_drawing_over_the_whole_vocabulary_pick_as_row_sampler_does() -> None:
    flagged = peaked_and_flat_whole_vocabulary_rows(np.float16, on_card=True)
    assert flagged["peaked"] < 0.01
    assert flagged["flat"] < 0.05


def test_a_draw_landing_by_a_block_edge_goes_to_the_host_and_one_inside_a_token_does_not() -> None:
    """Two halves of 256 equal tokens (a block each), the first holding exactly the row's uniform of the
    mass: the draw lands on the edge between tokens 255 and 256, within the graph's slack of it.
    The same draw over equal tokens lands in the middle of token 511 x uniform: served."""
    vocab = 512
    request = GenerationRequest([1], 9, temperature=1.0, seed=7)
    uniform = RowSampler(request, EOS, vocab, None).uniform()
    lifted = np.log(uniform / (1 - uniform))  # the first block's tokens: uniform of the whole
    logits = np.zeros((2, vocab), np.float32)
    logits[0, :256] = lifted
    logits[1] = np.linspace(0, 0.01, vocab)  # nearly equal: the draw far from every token's edges
    samplers = [RowSampler(request, EOS, vocab, None) for _ in range(2)]
    step = SamplerGraph(EOS, vocab).run(logits, samplers, [0, 0])
    assert step.host.tolist() == [True, False]
    edge = np.cumsum(np.exp(logits[0]) / np.exp(logits[0]).sum())[255]
    assert abs(edge - uniform) < 1e-6
    expected = RowSampler(request, EOS, vocab, None).choose(logits[1].copy(), 0)
    assert step.tokens[1] == expected
    assert samplers[0].choose(logits[0].copy(), 0) in (255, 256)


@pytest.mark.parametrize("vocab", [49152, 1000, 300, 40])
def test_no_running_sum_of_the_graph_spans_the_whole_vocabulary(vocab: int) -> None:
    """CumSum's CUDA kernel sums each position's prefix anew: every running sum is over a block, over the
    blocks or over the candidates, so a step costs work linear in the vocabulary."""
    model = onnx.shape_inference.infer_shapes(sampler_model(vocab, 256), strict_mode=True)
    graph = model.graph
    shapes = {v.name: v.type.tensor_type.shape.dim for v in [*graph.input, *graph.value_info]}
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    sums = [node for node in graph.node if node.op_type == "CumSum"]
    assert len(sums) == 3  # over the blocks' totals, inside the draw's block, over the candidates
    block = min(256, vocab)
    longest = max(block, -(-vocab // block), min(257, vocab))
    for node in sums:
        axis = int(constants[node.input[1]].reshape(-1)[0])
        length = shapes[node.input[0]][axis].dim_value
        assert 0 < length <= longest, (node.name, length)
        assert length < vocab or vocab <= 257


def test_prepare_makes_both_forms_sessions_for_an_element_ahead_of_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The paged engine prepares the forms its steps read when it starts, so the first request waits on
    no session: after `prepare("float16")`, a step of a run's rows as they are and one gathering them
    from among others make none."""
    rng = np.random.default_rng(89)
    vocab = 500
    graph = SamplerGraph(EOS, vocab)
    graph.prepare("float16")
    made: list[object] = []
    original = ort.InferenceSession

    def counted(*args: Any, **kwargs: Any) -> ort.InferenceSession:
        made.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counted)
    for rows, taken in ((8, np.arange(8)), (8, np.array([3, 11, 0, 7, 1, 5, 9, 2]))):
        samplers = [RowSampler(GenerationRequest([1], 9, seed=row), EOS, vocab, None) for row in range(rows)]
        run = random_logits(rng, 12, vocab).astype(np.float16)
        step = graph.run(ort.OrtValue.ortvalue_from_numpy(run), samplers, [0] * rows, taken)
        assert step.tokens.tolist() == np.argmax(run[taken].astype(np.float32), axis=1).tolist()
    assert made == []
    graph.run(
        ort.OrtValue.ortvalue_from_numpy(random_logits(rng, 4, vocab)), samplers[:2], [0, 0], np.array([0, 2])
    )
    assert len(made) == 1
