"""The CUDA model built with paged attention (`ortfleet model default --device cuda`), run by ortfleet
itself rather than og.Engine: each run takes packed rows (a prompt chunk, or a decoding row's last token)
and reads and writes their keys and values through block tables into one pool of KV blocks on the card.

The model's contract (onnxruntime's `PagedAttention`, CUDA only):

- `input_ids` int64 [tokens]: every row's new tokens, one row after another;
- `cumulative_sequence_lengths` int32 [rows + 1]: where each row's tokens start, then the total;
- `past_sequence_lengths` int32 [rows]: the tokens of each row already in the pool;
- `block_table` int32 [rows, width]: each row's blocks in token order (token t of a row is at offset
  t % block_size of block table[t // block_size]); a shorter row's table is padded, never read past its
  length;
- `attention_metadata` int32 [3], in host memory: the longest row's new tokens, the longest row's whole
  length, and a lower bound of that length (0 says none), so the kernel picks its backend without reading
  the card;
- `past_key_values.N.key` / `.value` [blocks, block_size, kv_heads, head_size]: the pool, bound as the
  same buffer to `present.N.key` / `.value` (the operator writes each run's new keys and values into it in
  place, and refuses two buffers);
- `logits` [tokens, vocab] (fp16): one row of logits for every token of the run, left on the card.

A run's rows may mix prefills and decodes in any order. Which blocks a row holds is the caller's (the
block manager's, blocks.py); this module keeps only the pool.

What a run returns (`returned_logits`, the contract of every runner: this one, cpu_model.py and reference.py):
each row's last token's logits, or, for a row that asks (`PackedRow.all_logits`: a prompt chunk whose
prompt log-probabilities are wanted), the logits of each of its new tokens; float32 [taken, vocab], the
rows in order (`by_row` cuts them per row). On the card only those rows come back (`RowGather`,
device_sampling/rows.py).

LoRA adapters (`PackedRow.adapter`, each row its own, in one run): the graph is the batcher's rewrite of
each targeted projection, `y += ((x @ A) * scale) @ B` (batcher/lora_graph.py), in fp16, with the scale
per packed token: each token gets its row's adapter's columns (lora.py's Columns.token_scale). The
adapters' A and B stay on the card (AdapterSet's layouts, made there), bound at each run.

CUDA graphs (`cuda_graph`, ORTFLEET_CUDA_GRAPH): the session's CUDA provider captures graphs, and a
pure-decode run (every row one token over a past, no adapter in the run) replays its bucket's graph
(decode_graphs.py: rows padded to a power of two, tables to a power-of-two width, padding rows writing
only a scratch block the pool holds past `blocks`); every other run is eager (`gpu_graph_id` -1). A
session whose graph is rewritten for adapters runs eagerly, as does one whose CUDA provider refuses
graphs, or whose first capture fails (a warning says why, once).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from worker.engines.batcher.lora_graph import ROW_SCALE
from worker.engines.genai_config import eos_token_ids, read_genai
from worker.engines.paged.decode_graphs import MAX_ROWS as MAX_ROWS
from worker.engines.paged.decode_graphs import DecodeGraphs, bind_pool, bucket_of, pad, run_options

if TYPE_CHECKING:
    import onnxruntime as ort

    from worker.engines.batcher.adapter_library import AdapterLibrary
    from worker.engines.batcher.graph import Layout
    from worker.engines.batcher.lora import AdapterSet
    from worker.engines.device_sampling.rows import RowGather

logger = logging.getLogger(__name__)

# MAX_ROWS (decode_graphs.py's, 256, imported from here too): rows a run may hold: onnxruntime's
# PagedAttention scans the rows' lengths in one block


class PackedRow(NamedTuple):  # a tuple: one is made for each row of each run
    tokens: Sequence[int]  # the row's new tokens in this run: a prompt chunk, or its last sampled token
    past: int  # the row's tokens already in the pool
    table: Sequence[int]  # its blocks in token order, enough for past + len(tokens) tokens
    all_logits: bool = False  # the logits of each of its new tokens come back, not only its last one's
    adapter: str | None = None  # the LoRA adapter the row runs with (None: the base model)

    @property
    def returned(self) -> int:
        """Rows of logits the run returns for it."""
        return len(self.tokens) if self.all_logits else 1


@dataclass(frozen=True)
class PagedShape:
    """What a paged model's folder says of its graph (genai_config.json)."""

    layers: int
    kv_heads: int
    head_size: int
    vocab: int
    context: int
    eos: frozenset[int]
    filename: str
    inputs: dict[str, str]
    outputs: dict[str, str]

    @classmethod
    def of(cls, model_dir: Path) -> PagedShape:
        config = read_genai(model_dir)["model"]
        decoder = config["decoder"]
        if "block_table" not in decoder.get("inputs", {}):
            raise ValueError(f"{model_dir} was not built with paged attention: its graph has no block_table")
        return cls(
            layers=decoder["num_hidden_layers"],
            kv_heads=decoder["num_key_value_heads"],
            head_size=decoder["head_size"],
            vocab=config["vocab_size"],
            context=config["context_length"],
            eos=eos_token_ids(model_dir),
            filename=decoder["filename"],
            inputs=decoder["inputs"],
            outputs=decoder["outputs"],
        )

    def block_bytes(self, block_size: int, itemsize: int = 2) -> int:
        """The pool's bytes for one block: keys and values of every layer."""
        return 2 * self.layers * block_size * self.kv_heads * self.head_size * itemsize


def pack(rows: Sequence[PackedRow], block_size: int) -> dict[str, np.ndarray]:
    """The graph's inputs but the pool for one run of `rows`; `taken` (not an input) holds the indexes,
    among the run's tokens, of those whose logits come back: each row's last token (whose logits pick its
    next token), or each of its tokens for a row that asks for all its logits."""
    if not rows:
        raise ValueError("a run needs at least one row")
    if len(rows) > MAX_ROWS:
        raise ValueError(f"a run holds at most {MAX_ROWS} rows, not {len(rows)}")
    count = len(rows)
    tokens, pasts, tables, all_logits, _ = zip(*rows, strict=True)  # the rows' columns, in one pass
    new = np.fromiter(map(len, tokens), np.int32, count)
    past = np.array(pasts, np.int32)
    used = -(-(past + new) // block_size)  # the blocks each row's tokens take
    held = np.fromiter(map(len, tables), np.int64, count)
    wrong = np.flatnonzero((new == 0) | (held < used))
    if wrong.size:
        index = int(wrong[0])
        if not new[index]:
            raise ValueError(f"row {index} has no token to run")
        end = int(past[index] + new[index])
        raise ValueError(
            f"row {index} needs {math.ceil(end / block_size)} blocks of {block_size} for {end} tokens, "
            f"its table holds {len(tables[index])}"
        )
    width = int(used.max())
    table = np.zeros((count, width), np.int32)
    inside = np.arange(width) < used[:, None]
    if (held == used).all():  # each table holds just the blocks its tokens take (a decode's, usually)
        table[inside] = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(held.sum()))
    else:
        blocks = used.tolist()
        table[inside] = [b for t, n in zip(tables, blocks, strict=True) for b in t[:n]]
    cumulative = np.zeros(count + 1, np.int32)
    np.cumsum(new, out=cumulative[1:])
    if any(all_logits):
        taken = np.concatenate(
            [
                np.arange(start, stop) if row.all_logits else np.array([stop - 1])
                for row, start, stop in zip(rows, cumulative[:-1], cumulative[1:], strict=True)
            ]
        ).astype(np.int64)
    else:  # each row's last token
        taken = cumulative[1:].astype(np.int64) - 1
    return {
        "input_ids": np.fromiter(itertools.chain.from_iterable(tokens), np.int64, int(cumulative[-1])),
        "cumulative_sequence_lengths": cumulative,
        "past_sequence_lengths": past,
        "block_table": table,
        "attention_metadata": np.array([new.max(), (past + new).max(), 0], np.int32),
        "taken": taken,
    }


def by_row(rows: Sequence[PackedRow], logits: np.ndarray) -> list[np.ndarray]:
    """A run's returned logits [taken, vocab] cut per row: each row's [returned, vocab] (its last token's
    alone, or each of its tokens' where it asked for all its logits)."""
    expected = sum(row.returned for row in rows)
    if len(logits) != expected:
        raise ValueError(f"{len(logits)} rows of logits for rows that take {expected}")
    ends = np.cumsum([row.returned for row in rows])
    return [logits[end - row.returned : end] for row, end in zip(rows, ends, strict=True)]


def is_pure_decode(rows: Sequence[PackedRow]) -> bool:
    """Whether a run may replay a CUDA graph: every row brings one token over a past, and no row has an
    adapter (whose A and B a graph could not follow)."""
    return 0 < len(rows) <= MAX_ROWS and all(
        len(row.tokens) == 1 and row.past > 0 and row.adapter is None for row in rows
    )


def pack_bucket(rows: Sequence[PackedRow], block_size: int, most: int, scratch: int) -> dict[str, np.ndarray]:
    """pack's arrays for a pure-decode run in its CUDA graph's bucket's shapes (decode_graphs.py's pad):
    rows padded to a power of two with rows that write only block `scratch`, tables to the bucket's
    width (`most`: the blocks of a row at the whole context), the bucket's attention bounds."""
    if not is_pure_decode(rows):
        raise ValueError(
            "only a run of decoding rows, one token each over a past and no adapter, has a bucket"
        )
    feeds = pack(rows, block_size)
    return pad(feeds, bucket_of(feeds, most), block_size, scratch)


def paged_session(
    model_dir: Path, device_id: int, graph: bytes | None = None, cuda_graph: bool = False
) -> ort.InferenceSession:
    """The folder's paged graph on the card, or `graph` (rewritten for adapters) with the folder's weights;
    with `cuda_graph`, its CUDA provider captures graphs (the runs that name one, `gpu_graph_id`)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    model: str | bytes = str(model_dir / PagedShape.of(model_dir).filename)
    if graph is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(model_dir)
        )
        model = graph
    return ort.InferenceSession(model, options, providers=_providers(device_id, cuda_graph))


def paged_graph(model_dir: Path, device_id: int, graph: bytes) -> tuple[ort.InferenceSession, Layout]:
    """A session of `graph` on the card for an adapter loaded at run time (AdapterLibrary's open_graph)."""
    from worker.engines.batcher.graph import Layout

    session = paged_session(model_dir, device_id, graph)
    return session, Layout.read(model_dir, session)


def _providers(device_id: int, cuda_graph: bool = False) -> list[Any]:
    cuda = {"device_id": str(device_id)} | ({"enable_cuda_graph": "1"} if cuda_graph else {})
    return [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]


class PagedModel:
    """The model's session on one card and its pool of `blocks` KV blocks of `block_size` tokens; with
    `adapters`, its graph rewritten for them; with `cuda_graph`, its pure-decode runs replayed as CUDA
    graphs, and one block more in the pool for their padding rows (see the module's docstring)."""

    def __init__(
        self,
        model_dir: Path,
        blocks: int,
        block_size: int,
        device_id: int = 0,
        adapters: AdapterLibrary | None = None,
        cuda_graph: bool = False,
    ) -> None:
        import onnxruntime as ort

        self.shape = shape = PagedShape.of(model_dir)
        self.vocab = shape.vocab
        self.blocks = blocks
        self.block_size = block_size
        self.device_id = device_id
        graph = None if adapters is None else adapters.rewritten()
        if cuda_graph and graph is not None:
            logger.info("the paged model runs eagerly: its graph is rewritten for LoRA adapters")
        self.session = self._open(model_dir, graph, cuda_graph and graph is None)
        self.adapters: AdapterSet | None = None if adapters is None else adapters.layouts()
        self._gather: RowGather | None = None
        kv_type = {"tensor(float16)": np.float16, "tensor(bfloat16)": None, "tensor(float)": np.float32}
        past_key = shape.inputs["past_key_names"] % 0
        element = kv_type[next(i.type for i in self.session.get_inputs() if i.name == past_key)]
        if element is None:
            raise ValueError("bfloat16 KV pools are not supported")
        self.graphs: DecodeGraphs | None = None
        self._eager: ort.RunOptions | None = None  # gpu_graph_id -1 where the session captures graphs
        dims = [blocks + int(self._captures), block_size, shape.kv_heads, shape.head_size]
        self.pool = [
            (
                ort.OrtValue.ortvalue_from_shape_and_type(dims, element, "cuda", device_id),
                ort.OrtValue.ortvalue_from_shape_and_type(dims, element, "cuda", device_id),
            )
            for _ in range(shape.layers)
        ]
        if self._captures:
            names = (shape.inputs, shape.outputs)
            widest = max(-(-shape.context // block_size), 1)  # a row's blocks at the whole context
            self.graphs = DecodeGraphs(
                self.session, names, shape.vocab, self.pool, block_size, widest, blocks, device_id
            )
            self._eager = run_options(-1)

    def _open(self, model_dir: Path, graph: bytes | None, cuda_graph: bool) -> ort.InferenceSession:
        """The session; with `cuda_graph`, one that captures graphs, or else (onnxruntime refused) an eager
        one and a warning saying why."""
        self._captures = cuda_graph
        if cuda_graph:
            try:
                return paged_session(model_dir, self.device_id, graph, cuda_graph=True)
            except Exception as e:  # onnxruntime's refusal, as it words it
                logger.warning("the paged model runs eagerly: its session cannot capture CUDA graphs (%s)", e)
                self._captures = False
        return paged_session(model_dir, self.device_id, graph)

    def run(self, rows: Sequence[PackedRow]) -> tuple[Any, np.ndarray]:
        """One run of `rows`: the logits of every token, on the card (an OrtValue [tokens, vocab]), and the
        indexes of those that come back (pack's `taken`). A run replayed as a CUDA graph (the module's
        docstring) has more rows of logits than tokens, padding rows' after the real ones, which `taken`
        never names; they stay in the graph's buffer until the next run of as many rows."""
        graphs = self.graphs
        if graphs is not None and self.adapters is None and is_pure_decode(rows):
            feeds = pack(rows, self.block_size)
            bucket = graphs.bucket(feeds)
            if bucket is not None:
                feeds = pad(feeds, bucket, self.block_size, self.blocks)  # block `blocks`: the scratch one
                if graphs.captured(bucket):
                    return graphs.run(feeds, bucket), feeds["taken"]  # a failure fails its rows
                try:
                    return graphs.run(feeds, bucket), feeds["taken"]
                except Exception as e:  # the capture failed: the run again, eagerly (it writes the same KV)
                    logger.warning("the paged model runs eagerly: capturing a CUDA graph failed (%s)", e)
                    self.graphs = None
        return self._eager_run(rows)

    def _eager_run(self, rows: Sequence[PackedRow]) -> tuple[Any, np.ndarray]:
        feeds = pack(rows, self.block_size)
        taken = feeds.pop("taken")
        shape = self.shape
        binding = self.session.io_binding()
        binding.bind_output(shape.outputs["logits"], "cuda", self.device_id)  # the first of the outputs
        for name, array in feeds.items():
            binding.bind_cpu_input(shape.inputs[name], array)
        if self.adapters is not None:
            adapters = [row.adapter for row in rows]
            columns = self.adapters.layout(adapters)
            columns.bind(binding)  # on the card already
            scale = columns.token_scale(adapters, [len(row.tokens) for row in rows])  # each token its row's
            binding.bind_cpu_input(ROW_SCALE, scale)
        bind_pool(binding, shape.inputs, shape.outputs, self.pool)
        self.session.run_with_iobinding(binding, self._eager)
        return binding.get_outputs()[0], taken

    def returned_logits(self, rows: Sequence[PackedRow]) -> np.ndarray:
        """One run of `rows`, and each row's last token's logits on the host (each of its tokens' for a row
        with all_logits), float32 [taken, vocab]: taken from the run's logits and cast on the card
        (device_sampling/rows.py's RowGather), so a prompt chunk that does not ask brings one row back."""
        logits, taken = self.run(rows)
        return self._logit_rows.take(logits, taken)

    def use_adapters(
        self, session: tuple[ort.InferenceSession, Layout] | None, adapters: AdapterSet | None
    ) -> None:
        """From the next run on: these adapters' layouts, and `session` where the graph gained projections
        (an adapter loaded at run time: paged_graph). The pool stays."""
        if session is not None:
            self.session = session[0]
            self._eager = None  # a session that captures no graph: its runs are all eager
            if self.graphs is not None:
                logger.info("the paged model runs eagerly: its graph is rewritten for LoRA adapters")
                self.graphs = None
        self.adapters = adapters

    @property
    def _logit_rows(self) -> RowGather:
        if self._gather is None:
            from worker.engines.device_sampling.rows import RowGather

            self._gather = RowGather(_providers(self.device_id))
        return self._gather
