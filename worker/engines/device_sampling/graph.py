"""The sampler graph: one ONNX model that picks every row's next token of a step at once, as `RowSampler`
does (worker/engines/batcher/sampler.py), so that only token ids and the asked-for log-probabilities leave the
device. Rows it cannot pick exactly as `RowSampler` would are flagged `host`, for the host path.

In the graph's order: the repetition penalty over each row's penalized ids, the presence and frequency
penalties over its counted ids, its logit bias, end of sequence masked while `mask_eos`; then greedy rows
take the first maximum, and sampled rows divide by their temperature and draw with their `uniform` from
their softmax: over the whole vocabulary in token order, or over the `candidates` likeliest tokens when
top_k or top_p is set. Log-probabilities are of the unmodified logits, as the batcher reports them.

A sampled row is flagged when top_k is over `candidates`, when its top_p nucleus may be wider than the
candidates (RowSampler then sorts the whole vocabulary), when two nearly equal probabilities sit where
their order decides the pick (RowSampler's order among ties is argpartition's): the pick lands on one of
them, or they sit at the nucleus' cut; or when its draw lands on the last candidate's edge. (Ties are
common among float16 logits: a row whose pick lands elsewhere is served.) Padded id slots hold -1.

A row drawing over the whole vocabulary takes its running sum in float64 on two levels (`_whole_draw`:
block totals, then inside the draw's block), work linear in the vocabulary, as RowSampler takes its own
in float64, and is flagged where its draw lands within _DRAW_SLACK of the total of a token's edge.

The logits come in one of two forms (`sampler_model`'s element and gathered): the rows' [rows, vocab], or
the run's [tokens, vocab] as the model leaves them (float16 on a card) with `taken`, each row's token,
gathered and cast to float32 at the graph's head. Every op and element type it uses has a kernel on the
CUDA provider (onnxruntime's OperatorKernels.md), and nothing computes a shape, so on a card every node
runs there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx


class TensorProto:  # onnx.TensorProto's element types (onnx comes with the `model` extra)
    FLOAT, INT32, INT64, BOOL, FLOAT16, DOUBLE = 1, 6, 7, 9, 10, 11


OPSET = 18
# onnxruntime's names of the logits' element types (OrtValue.data_type(), numpy's dtype) to ONNX's
ELEMENTS = {
    "tensor(float)": TensorProto.FLOAT,
    "tensor(float16)": TensorProto.FLOAT16,
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
}
TOP_LOGPROBS = 20  # the top log-probabilities the graph returns; a row reads the first it asked for
_NUCLEUS_MARGIN = 1e-5  # a nucleus whose candidates' sum is this close to top_p goes to the host
_TIE_MARGIN = 2e-6  # relative gap under which two probabilities count as tied
_BLOCK = 256  # tokens a block of a whole-vocabulary draw's two-level running sum (_whole_draw)
# of the total a whole-vocabulary draw keeps from its token's edges: the softmax's own differences from
# numpy's (a few float32 ulps a probability, at most about 2^-21 of the total summed), the uniform's
# rounding to float32 (2^-24) and the float64 sums' order (about vocab x 2^-53)
_DRAW_SLACK = 2.0**-20
INPUTS: tuple[tuple[str, int, list[str | int]], ...] = (
    ("logits", TensorProto.FLOAT, ["rows", "vocab"]),
    ("eos", TensorProto.BOOL, ["vocab"]),
    ("greedy", TensorProto.BOOL, ["rows"]),
    ("temperature", TensorProto.FLOAT, ["rows"]),
    ("top_k", TensorProto.INT64, ["rows"]),
    ("top_p", TensorProto.DOUBLE, ["rows"]),
    ("uniform", TensorProto.FLOAT, ["rows"]),
    ("repetition_penalty", TensorProto.FLOAT, ["rows"]),
    ("penalized", TensorProto.INT64, ["rows", "penalized_width"]),
    ("presence_penalty", TensorProto.FLOAT, ["rows"]),
    ("frequency_penalty", TensorProto.FLOAT, ["rows"]),
    ("counted", TensorProto.INT64, ["rows", "counted_width"]),
    ("counts", TensorProto.FLOAT, ["rows", "counted_width"]),
    ("bias_ids", TensorProto.INT64, ["rows", "bias_width"]),
    ("bias", TensorProto.FLOAT, ["rows", "bias_width"]),
    ("mask_eos", TensorProto.BOOL, ["rows"]),
    ("host_in", TensorProto.BOOL, ["rows"]),
)
OUTPUTS: tuple[tuple[str, int, list[str | int]], ...] = (
    ("token", TensorProto.INT64, ["rows"]),
    ("logprob", TensorProto.FLOAT, ["rows"]),
    ("top_ids", TensorProto.INT64, ["rows", "top"]),
    ("top_logprobs", TensorProto.FLOAT, ["rows", "top"]),
    ("host", TensorProto.BOOL, ["rows"]),
)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self._count = 0

    def op(self, kind: str, *inputs: str, outputs: int = 1, **attributes: Any) -> str:
        names = [self._name(kind) for _ in range(outputs)]
        from onnx import helper

        self.nodes.append(helper.make_node(kind, list(inputs), names, **attributes))
        return names[0]

    def op2(self, kind: str, *inputs: str, **attributes: Any) -> tuple[str, str]:
        first = self.op(kind, *inputs, outputs=2, **attributes)
        return first, self.nodes[-1].output[1]

    def const(self, value: np.ndarray) -> str:
        name = self._name("const")
        from onnx import numpy_helper

        self.constants.append(numpy_helper.from_array(value, name))
        return name

    def _name(self, kind: str) -> str:
        self._count += 1
        return f"{kind.lower()}_{self._count}"


def sampler_model(
    vocab_size: int, candidates: int = 256, element: int = TensorProto.FLOAT, gathered: bool = False
) -> onnx.ModelProto:
    """The sampler graph over a vocabulary of `vocab_size`; `candidates`: the likeliest tokens top_k and
    top_p choose among (RowSampler's _NUCLEUS_CANDIDATES).

    `logits` holds the rows' logits in `element` (FLOAT, or FLOAT16 as a model on the card leaves them),
    cast to float32 at the graph's head: [rows, vocab], or with `gathered` the run's [tokens, vocab] and an
    int64 input `taken` [rows], the tokens whose logits the rows sample from (Gather on axis 0 first).

    The vocabulary's size is a constant of the graph rather than read with Shape, so that no node computes
    on host memory: on the CUDA provider every node stays on the card (onnxruntime places shape
    arithmetic on the CPU provider)."""
    import onnx
    from onnx import helper

    b = _Builder()

    def i64(*values: int) -> str:
        return b.const(np.array(values, np.int64))

    def f32(value: float) -> str:
        return b.const(np.array(value, np.float32))

    cols = i64(1)
    vocab = i64(vocab_size)  # [1]
    source = b.op("Gather", "logits", "taken", axis=0) if gathered else "logits"
    raw = source if element == TensorProto.FLOAT else b.op("Cast", source, to=TensorProto.FLOAT)

    # [rows] int64 zeros, made from a row input less itself so that they take no shape arithmetic
    zero = b.op("Sub", "top_k", "top_k")
    # penalties and bias on the logits with one spare column of zeros, where padded slots (-1) point
    zeros = b.op("Cast", zero, to=TensorProto.FLOAT)
    logits = b.op("Concat", raw, b.op("Unsqueeze", zeros, cols), axis=1)

    def slots(ids: str) -> str:
        return b.op("Where", b.op("Less", ids, i64(0)), vocab, ids)

    def column(values: str) -> str:
        return b.op("Unsqueeze", values, cols)

    at = slots("penalized")
    scores = b.op("GatherElements", logits, at, axis=1)
    penalty = column("repetition_penalty")
    positive = b.op("Greater", scores, f32(0.0))
    changed = b.op("Where", positive, b.op("Div", scores, penalty), b.op("Mul", scores, penalty))
    logits = b.op("ScatterElements", logits, at, changed, axis=1)

    at = slots("counted")
    scores = b.op("GatherElements", logits, at, axis=1)
    lowered = b.op("Add", b.op("Mul", "counts", column("frequency_penalty")), column("presence_penalty"))
    logits = b.op("ScatterElements", logits, at, b.op("Sub", scores, lowered), axis=1)

    at = slots("bias_ids")
    scores = b.op("GatherElements", logits, at, axis=1)
    logits = b.op("ScatterElements", logits, at, b.op("Add", scores, "bias"), axis=1)

    logits = b.op("Slice", logits, i64(0), vocab, cols)
    masked = b.op("And", column("mask_eos"), b.op("Unsqueeze", "eos", i64(0)))
    logits = b.op("Where", masked, f32(-np.inf), logits)

    # greedy rows: the first of the maxima, as np.argmax (no kernel's order among ties decides it)
    peak = b.op("ReduceMax", logits, cols, keepdims=1)
    token_ids = b.const(np.arange(vocab_size, dtype=np.int64).reshape(1, vocab_size))
    at_peak = b.op("Where", b.op("Equal", logits, peak), token_ids, vocab)
    greedy_token = b.op("ReduceMin", at_peak, cols, keepdims=0)

    # sampled rows: the softmax of logits / temperature, as RowSampler's _softmax
    scaled = b.op("Div", logits, column("temperature"))
    shifted = b.op("Exp", b.op("Sub", scaled, b.op("ReduceMax", scaled, cols, keepdims=1)))
    probabilities = b.op("Div", shifted, b.op("ReduceSum", shifted, cols, keepdims=1))
    uniform = column("uniform")

    has_top_k = b.op("Greater", "top_k", i64(0))
    has_top_p = b.op("Less", "top_p", b.op("Cast", f32(1.0), to=TensorProto.DOUBLE))
    restricted = b.op("Or", has_top_k, has_top_p)
    sampled = b.op("Not", "greedy")

    # no top_k, no top_p: every token in token order, for the rows that draw so (none in a step of greedy,
    # top_k and top_p rows), in float64 and on two levels, work linear in the vocabulary (CumSum's CUDA
    # kernel sums each position's prefix anew): each block's total, the running sum over the blocks, the
    # block the draw lands in, and the running sum inside that block alone.
    whole = b.op("And", b.op("And", sampled, b.op("Not", restricted)), b.op("Not", "host_in"))
    which = b.op("Squeeze", b.op("NonZero", whole), i64(0))  # [drawing rows]
    drawing = b.op("Cast", b.op("Gather", probabilities, which, axis=0), to=TensorProto.DOUBLE)
    whole_token, whole_unsure = _whole_draw(b, drawing, b.op("Gather", "uniform", which, axis=0), vocab_size)
    whole_token = b.op("ScatterElements", zero, which, whole_token, axis=0)
    whole_unsure = b.op("ScatterElements", zero, which, whole_unsure, axis=0)
    whole_unsure = b.op("Cast", whole_unsure, to=TensorProto.BOOL)

    # top_k or top_p: the candidates, likeliest first (TopK puts the lower index first among ties)
    limit = i64(candidates)
    width = min(candidates + 1, vocab_size)
    values, ids = b.op2("TopK", probabilities, i64(width), axis=1, largest=1, sorted=1)
    position = b.const(np.arange(width, dtype=np.int64).reshape(1, width))
    fits = i64(min(candidates, vocab_size))
    wanted = b.op("Min", b.op("Where", has_top_k, "top_k", limit), fits)  # over: host
    taken = b.op("Less", position, column(wanted))
    running = b.op("CumSum", values, cols)
    nucleus = b.op("Less", b.op("Cast", running, to=TensorProto.DOUBLE), column("top_p"))
    inside = b.op("Cast", b.op("And", taken, nucleus), to=TensorProto.INT64)
    keep = b.op("Add", b.op("ReduceSum", inside, cols, keepdims=0), i64(1))
    kept = b.op("Where", has_top_p, b.op("Min", keep, wanted), wanted)
    kept_column = column(kept)
    end = b.op("GatherElements", running, b.op("Sub", kept_column, i64(1)), axis=1)
    threshold = b.op("Mul", uniform, end)
    within = b.op("Less", position, kept_column)
    below = b.op("And", within, b.op("LessOrEqual", running, threshold))
    pick = b.op("ReduceSum", b.op("Cast", below, to=TensorProto.INT64), cols, keepdims=0)
    edge = b.op("GreaterOrEqual", pick, kept)  # the draw reached the last kept candidate's end
    pick = b.op("Min", pick, b.op("Sub", kept, i64(1)))
    candidate_token = b.op("Squeeze", b.op("GatherElements", ids, column(pick), axis=1), cols)

    # rows whose pick RowSampler may make otherwise
    over_k = b.op("Greater", "top_k", limit)
    taken_sum = b.op("ReduceSum", b.op("Mul", values, b.op("Cast", taken, to=TensorProto.FLOAT)), cols)
    near_p = b.op(
        "Less",
        b.op("Cast", b.op("Squeeze", taken_sum, cols), to=TensorProto.DOUBLE),
        b.op("Add", "top_p", b.op("Cast", f32(_NUCLEUS_MARGIN), to=TensorProto.DOUBLE)),
    )
    wide = b.op("And", b.op("And", b.op("Not", has_top_k), has_top_p), near_p)
    upper = b.op("Slice", values, i64(0), i64(-1), cols)
    lower = b.op("Slice", values, i64(1), i64(np.iinfo(np.int64).max), cols)
    gap = b.op("Sub", upper, lower)
    tied = b.op("LessOrEqual", gap, b.op("Mul", upper, f32(_TIE_MARGIN)))
    tied = b.op("And", tied, b.op("Greater", upper, f32(0.0)))  # candidates i and i + 1 (nearly) tie
    # A tie's order changes no running sum, only which of the tied ids sits at a position: it matters
    # where the pick lands on a tied candidate, or (top_p) where a near tie sits at the nucleus' cut.
    none = b.op("Unsqueeze", b.op("Cast", zero, to=TensorProto.INT32), cols)
    flags = b.op("Concat", none, b.op("Cast", tied, to=TensorProto.INT32), none, axis=1)  # pair i at i + 1

    def tied_pair(after: str) -> str:  # [rows, 1] int32: the pair (after - 1, after) ties
        return b.op("GatherElements", flags, after, axis=1)

    picked = column(pick)
    around = b.op("Add", tied_pair(picked), tied_pair(b.op("Add", picked, i64(1))))
    cut = b.op("Add", tied_pair(b.op("Sub", kept_column, i64(1))), tied_pair(kept_column))
    cut = b.op("Mul", cut, b.op("Cast", column(has_top_p), to=TensorProto.INT32))
    tie = b.op("Cast", b.op("Squeeze", b.op("Add", around, cut), cols), to=TensorProto.BOOL)
    unsure = b.op("Or", b.op("Or", wide, tie), b.op("Or", over_k, edge))
    unsure = b.op("Or", b.op("And", restricted, unsure), whole_unsure)  # whole_unsure: unrestricted rows'
    host = b.op("Or", "host_in", b.op("And", sampled, unsure))

    sampled_token = b.op("Where", restricted, candidate_token, whole_token)
    b.nodes.append(helper.make_node("Where", ["greedy", greedy_token, sampled_token], ["token"]))
    b.nodes.append(helper.make_node("Identity", [host], ["host"]))

    # log-probabilities of the unmodified logits
    logprobs = b.op("LogSoftmax", raw, axis=1)
    _, top_ids = b.op2("TopK", raw, i64(min(TOP_LOGPROBS, vocab_size)), axis=1, largest=1, sorted=1)
    b.nodes.append(helper.make_node("Identity", [top_ids], ["top_ids"]))
    b.nodes.append(helper.make_node("GatherElements", [logprobs, top_ids], ["top_logprobs"], axis=1))
    chosen = b.op("GatherElements", logprobs, column("token"), axis=1)
    b.nodes.append(helper.make_node("Squeeze", [chosen, cols], ["logprob"]))

    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in INPUTS[1:]]
    rows = "tokens" if gathered else "rows"
    inputs.insert(0, helper.make_tensor_value_info("logits", element, [rows, vocab_size]))
    if gathered:
        inputs.append(helper.make_tensor_value_info("taken", TensorProto.INT64, ["rows"]))
    graph = helper.make_graph(
        b.nodes,
        "sampler",
        inputs,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in OUTPUTS],
        initializer=b.constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _whole_draw(b: _Builder, probabilities: str, uniform: str, vocab_size: int) -> tuple[str, str]:
    """The token each row's `uniform` [rows] float32 draws from its `probabilities` [rows, vocab] float64 in
    token order, and 1 where RowSampler may put the draw elsewhere (int64, [rows]).

    RowSampler picks the first token j whose running sum C_j (np.cumsum in float64, one token after
    another) exceeds uniform x C[-1]. Here the same sums are taken in blocks (each block's total, their
    running sum, then the running sum inside the draw's block alone), which differ from C by about vocab x
    2^-53 of the total; the probabilities themselves differ from numpy's by a few float32 ulps each. A draw
    within _DRAW_SLACK of the total of its token's edges goes to the host: a share of the rows of about
    2 x _DRAW_SLACK over the drawn token's probability (tests/test_sampler_graph.py measures it)."""

    def i64(*values: int) -> str:
        return b.const(np.array(values, np.int64))

    def f64(value: float) -> str:
        return b.const(np.array(value, np.float64))

    cols = i64(1)
    width = min(_BLOCK, vocab_size)
    blocks = -(-vocab_size // width)
    padded = probabilities
    if blocks * width > vocab_size:  # zeros after the last token, from the row itself (no shape read)
        spare = b.op("Slice", probabilities, i64(0), i64(blocks * width - vocab_size), cols)
        padded = b.op("Concat", probabilities, b.op("Mul", spare, f64(0.0)), axis=1)
    grid = b.op("Reshape", padded, i64(0, blocks, width))  # [rows, blocks, width]
    totals = b.op("ReduceSum", grid, i64(2), keepdims=0)  # [rows, blocks]
    running = b.op("CumSum", totals, cols)  # each block's end
    total = b.op("Slice", running, i64(-1), i64(blocks), cols)  # [rows, 1]
    drawn = b.op("Unsqueeze", b.op("Cast", uniform, to=TensorProto.DOUBLE), cols)
    target = b.op("Mul", drawn, total)
    passed = b.op("Cast", b.op("LessOrEqual", running, target), to=TensorProto.INT64)
    block = b.op("Min", b.op("ReduceSum", passed, cols, keepdims=1), i64(blocks - 1))  # [rows, 1]
    starts = b.op("Concat", b.op("Mul", total, f64(0.0)), running, axis=1)  # [rows, blocks + 1]
    start = b.op("GatherElements", starts, block, axis=1)
    first = b.op("Mul", block, i64(width))
    offsets = b.const(np.arange(width, dtype=np.int64).reshape(1, width))
    inside = b.op("GatherElements", padded, b.op("Add", first, offsets), axis=1)  # [rows, width]
    edges = b.op(
        "Concat", start, b.op("Add", start, b.op("CumSum", inside, cols)), axis=1
    )  # [rows, width + 1]
    passed = b.op("Cast", b.op("LessOrEqual", edges, target), to=TensorProto.INT64)
    step = b.op("ReduceSum", passed, cols, keepdims=1)  # 1 + the token's place in its block
    lower = b.op("GatherElements", edges, b.op("Sub", step, i64(1)), axis=1)
    upper = b.op("GatherElements", edges, b.op("Min", step, i64(width)), axis=1)
    token = b.op("Min", b.op("Add", first, b.op("Sub", step, i64(1))), i64(vocab_size - 1))

    margin = b.op("Mul", total, f64(_DRAW_SLACK))  # [rows, 1]
    near = b.op(
        "Or",
        b.op("LessOrEqual", b.op("Sub", target, lower), margin),
        b.op("LessOrEqual", b.op("Sub", upper, target), margin),
    )
    unsure = b.op("Cast", b.op("Squeeze", near, cols), to=TensorProto.INT64)
    return b.op("Squeeze", token, cols), unsure
