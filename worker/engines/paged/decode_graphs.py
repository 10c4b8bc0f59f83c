"""CUDA graphs for the paged model's pure-decode runs (model.py): the shapes a run is captured in, pack's
arrays padded into them (`pad`; model.py's pack_bucket packs rows so), and the captured graphs of one
session (DecodeGraphs). It imports nothing of model.py, which runs through it.

A captured graph replays the kernels it recorded, on the addresses and shapes it recorded, without
looking at its inputs again: so a decode run is padded to a bucket of rows (1, 2, 4 ... MAX_ROWS) and of
block-table columns (a power of two, at least MIN_WIDTH, at most the blocks a row of the whole context
takes), as og.Engine buckets its own paged decode steps (onnxruntime-genai's paged_key_value_cache.h
GetGraphBlockTableColumns, varlen_decoder_io.cpp GraphId). Each bucket has its own graph and its own
buffers on the card.

- A padding row runs one token (id 0) at past 0 into `scratch`, a block the block manager never hands
  out (the pool holds one block past the manager's), so it writes nothing a real row reads; its logits
  are never taken.
- `attention_metadata`, read on the host only when the graph is captured, describes the whole bucket
  rather than the run (og's GetAttentionMetadataForGraph): one new token a row, at most width x
  block_size tokens a row, and a lower bound of the longest row's length that holds for every run the
  bucket takes: a run lands in a width past MIN_WIDTH only when its longest table is wider than the
  width below.

What onnxruntime asks of a captured run (onnxruntime 1.32: cuda_execution_provider.cc, OnRunStart and
OnRunEnd; inference_session.cc, Run): the CUDA provider option enable_cuda_graph on the session, whose
nodes must all be on the CUDA provider but for shape computations on the CPU, with no Memcpy node; a run
option `gpu_graph_id` naming the graph (-1: eager); a graph is captured once the provider's warm-up runs
are done, the session running a new id again within the same call until it is, and a replay reads
neither the inputs nor the outputs bound: it launches the kernels on the addresses they were captured
with. So the device inputs are updated in place (OrtValue.update_inplace) and bound once a bucket, and
the host input attention_metadata, read by PagedAttention only while capturing, holds for the bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import onnxruntime as ort

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # rows a run may hold (model.py's, which imports it from here)
MIN_WIDTH = 8  # block-table columns of the narrowest bucket (og's kMinGraphBlockTableColumns)
PADDING_TOKEN = 0


class Bucket(NamedTuple):
    rows: int
    width: int

    @property
    def graph_id(self) -> int:
        """Its `gpu_graph_id`: positive (onnxruntime reserves -1 for eager runs and 0 for its default)."""
        return self.rows << 16 | self.width


def rows_bucket(rows: int) -> int:
    """The smallest power of two that holds `rows`."""
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"a run holds 1 to {MAX_ROWS} rows, not {rows}")
    return 1 << (rows - 1).bit_length()


def width_bucket(columns: int, most: int) -> int:
    """The block-table width of the bucket for a run whose longest table takes `columns` blocks: a power
    of two from MIN_WIDTH, or `most` (the blocks a row of the whole context takes) where the next power
    of two would pass it."""
    if not 0 < columns <= most:
        raise ValueError(f"a row's table takes 1 to {most} blocks here, not {columns}")
    width = min(MIN_WIDTH, most)
    while width < columns:
        width = most if width * 2 > most else width * 2
    return width


def bucket_of(feeds: dict[str, np.ndarray], most: int) -> Bucket:
    """The bucket of a run packed by model.py's pack (its table is as wide as its longest row's blocks)."""
    return Bucket(
        rows_bucket(len(feeds["past_sequence_lengths"])), width_bucket(feeds["block_table"].shape[1], most)
    )


def bucket_metadata(width: int, block_size: int) -> np.ndarray:
    """`attention_metadata` for every run of a bucket of `width` columns: [longest new tokens (1),
    longest row (width x block_size), a lower bound of the longest row]."""
    lower = 1
    if width > MIN_WIDTH:
        below = 1 << (width - 1).bit_length() - 1  # the widest power of two narrower than `width`
        lower = below * block_size + 1
    return np.array([1, width * block_size, lower], np.int32)


def pad(feeds: dict[str, np.ndarray], bucket: Bucket, block_size: int, scratch: int) -> dict[str, np.ndarray]:
    """pack's arrays of a pure-decode run (every row one token) in `bucket`'s shapes: padding rows after
    the real ones, each one token (PADDING_TOKEN) at past 0 in block `scratch`, every table widened to
    the bucket's width, and the bucket's attention_metadata. `taken` still names the real rows only."""
    count = len(feeds["past_sequence_lengths"])
    table = feeds["block_table"]
    if len(feeds["input_ids"]) != count:
        raise ValueError("only a run of one token a row has a bucket")
    if count > bucket.rows or table.shape[1] > bucket.width:
        raise ValueError(f"a run of {count} rows of {table.shape[1]} blocks does not fit bucket {bucket}")
    extra = bucket.rows - count
    padded_table = np.zeros((bucket.rows, bucket.width), np.int32)
    padded_table[:count, : table.shape[1]] = table
    padded_table[count:, 0] = scratch
    return {
        "input_ids": np.concatenate([feeds["input_ids"], np.full(extra, PADDING_TOKEN, np.int64)]),
        "cumulative_sequence_lengths": np.arange(bucket.rows + 1, dtype=np.int32),  # one token a row
        "past_sequence_lengths": np.concatenate([feeds["past_sequence_lengths"], np.zeros(extra, np.int32)]),
        "block_table": padded_table,
        "attention_metadata": bucket_metadata(bucket.width, block_size),
        "taken": feeds["taken"],
    }


def bind_pool(
    binding: Any, inputs: dict[str, str], outputs: dict[str, str], pool: Sequence[tuple[Any, Any]]
) -> None:
    """Each layer's keys and values as its past input and its present output (the names genai_config.json
    gives the graph's): one buffer, written in place."""
    for layer, (key, value) in enumerate(pool):
        binding.bind_ortvalue_input(inputs["past_key_names"] % layer, key)
        binding.bind_ortvalue_input(inputs["past_value_names"] % layer, value)
        binding.bind_ortvalue_output(outputs["present_key_names"] % layer, key)
        binding.bind_ortvalue_output(outputs["present_value_names"] % layer, value)


def run_options(graph_id: int) -> ort.RunOptions:
    """Run options naming the graph a run captures or replays (-1: an eager run, on a session whose CUDA
    provider captures graphs; without the entry onnxruntime would capture it as graph 0)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


class _Captured(NamedTuple):
    binding: Any  # the session's IOBinding of the bucket, made once
    options: ort.RunOptions
    inputs: dict[str, Any]  # pack's name -> its OrtValue on the card, updated in place before each run
    logits: Any  # the OrtValue [rows, vocab] the graph writes
    metadata: Any  # attention_metadata's OrtValue on the host, kept alive with the binding


class DecodeGraphs:
    """The CUDA graphs of one session's pure-decode runs: one a bucket, captured on the bucket's first
    run (run once eagerly first; onnxruntime then runs it eagerly until its warm-up count is met, and
    captures and replays it, all in that one call), each reading its inputs from buffers on the card
    of its own and writing its logits to its rows bucket's, so every replay finds them where it was
    captured. A run's logits stay in that buffer until the next run of the same rows bucket: take them
    before the next run. `names`: the graph's inputs and outputs as genai_config.json names them,
    `widest`: the blocks of a row at the whole context, `scratch`: the pool's block past the block
    manager's, that padding rows write."""

    def __init__(
        self,
        session: ort.InferenceSession,
        names: tuple[dict[str, str], dict[str, str]],
        vocab: int,
        pool: Sequence[tuple[Any, Any]],
        block_size: int,
        widest: int,
        scratch: int,
        device_id: int,
    ) -> None:
        self.session = session
        self.inputs, self.outputs = names
        self.pool = pool
        self.block_size = block_size
        self.widest = widest
        self.scratch = scratch
        self.device_id = device_id
        logits = next(output for output in session.get_outputs() if output.name == self.outputs["logits"])
        self._logits_type = {"tensor(float16)": np.float16, "tensor(float)": np.float32}[logits.type]
        self._vocab = vocab
        self._by_rows: dict[int, dict[str, Any]] = {}  # a rows bucket's buffers, shared by its widths
        self._captured: dict[Bucket, _Captured] = {}
        self._eager = run_options(-1)
        self.runs = 0  # runs through a graph, the capturing ones among them

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets captured so far, in the order they were."""
        return list(self._captured)

    def bucket(self, feeds: dict[str, np.ndarray]) -> Bucket | None:
        """The bucket of a pure-decode run packed by pack (None: its longest row is past the widest)."""
        return bucket_of(feeds, self.widest) if feeds["block_table"].shape[1] <= self.widest else None

    def run(self, feeds: dict[str, np.ndarray], bucket: Bucket) -> Any:
        """A run of pad's arrays for `bucket` through its graph: the logits [bucket rows, vocab] on the
        card, the padding rows' last."""
        captured = self._captured.get(bucket)
        first = captured is None
        if captured is None:
            captured = self._prepare(bucket)
        for name, value in captured.inputs.items():
            value.update_inplace(feeds[name])  # a copy from pageable memory, outside onnxruntime's stream:
        captured.binding.synchronize_inputs()  # done before the run reads it (the provider's device sync)
        if first:  # the bucket's shapes once eagerly: the memory they take is allocated before the capture
            self.session.run_with_iobinding(captured.binding, self._eager)  # (it writes the same KV again)
        self.session.run_with_iobinding(captured.binding, captured.options)
        self.runs += 1
        return captured.logits

    def captured(self, bucket: Bucket) -> bool:
        return bucket in self._captured

    def _prepare(self, bucket: Bucket) -> _Captured:
        import onnxruntime as ort

        def on_card(dims: list[int], element: type) -> Any:
            return ort.OrtValue.ortvalue_from_shape_and_type(dims, element, "cuda", self.device_id)

        rows = bucket.rows
        shared = self._by_rows.get(rows)
        if shared is None:
            shared = self._by_rows[rows] = {
                "input_ids": on_card([rows], np.int64),
                "cumulative_sequence_lengths": on_card([rows + 1], np.int32),
                "past_sequence_lengths": on_card([rows], np.int32),
                "logits": on_card([rows, self._vocab], self._logits_type),
            }
        names = ("input_ids", "cumulative_sequence_lengths", "past_sequence_lengths")
        inputs = {name: shared[name] for name in names}
        inputs["block_table"] = on_card([rows, bucket.width], np.int32)
        metadata = ort.OrtValue.ortvalue_from_numpy(bucket_metadata(bucket.width, self.block_size))
        binding = self.session.io_binding()
        binding.bind_ortvalue_output(self.outputs["logits"], shared["logits"])
        for name, value in inputs.items():
            binding.bind_ortvalue_input(self.inputs[name], value)
        binding.bind_ortvalue_input(self.inputs["attention_metadata"], metadata)
        bind_pool(binding, self.inputs, self.outputs, self.pool)
        captured = _Captured(binding, run_options(bucket.graph_id), inputs, shared["logits"], metadata)
        self._captured[bucket] = captured
        logger.info(
            "capturing the paged model's decode runs of %d rows and %d blocks a row as CUDA graph %d",
            rows, bucket.width, bucket.graph_id,
        )  # fmt: skip
        return captured
