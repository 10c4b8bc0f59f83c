"""The model folder's decoder graph on an onnxruntime InferenceSession, run on rows of KV slots.

The graph ORT-GenAI's builder writes for GroupQueryAttention models takes `input_ids`, an
`attention_mask` and `past_key_values.N.key|value` [batch, kv_heads, past, head]. It derives each row's
length from the mask's row sum (seqlens_k = sum - 1) and the rotary positions from that length, and
writes a row's new KV at that length. So rows of different lengths share a run right-padded: row b's KV
sits at [0, length_b) of its slot, its mask is ones over length_b + new tokens. Past and present are
bound to the same buffer (ORT-GenAI's share-buffer mode): a run copies no KV. A graph whose rotary
embedding is not fused into its attention (Hunyuan's, which norms q and k after it) takes
`position_ids` too: the same positions, derived here from the mask as the attention derives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from worker.engines.batcher.lora_graph import ROW_SCALE
from worker.engines.genai_config import read_genai

if TYPE_CHECKING:
    from worker.engines.batcher.lora import AdapterSet, Columns


class UnsupportedGraph(ValueError):
    """The folder's decoder is not one the batcher can run (it falls back to og.Engine)."""


@dataclass(frozen=True)
class Layout:
    past_names: list[str]  # every layer's key then value, as the graph's inputs
    present_names: list[str]  # the same order: a present is matched to its past by name, not position
    kv_heads: int
    head_size: int
    vocab_size: int
    position_ids: str | None  # the input's name, where the graph takes positions

    @classmethod
    def read(cls, model_dir: Path, session: ort.InferenceSession) -> Layout:
        decoder = read_genai(model_dir)["model"]["decoder"]
        names = {i.name for i in session.get_inputs()}
        position_ids = decoder["inputs"].get("position_ids", "position_ids")
        past, present = [], []
        for layer in range(decoder["num_hidden_layers"]):
            for kind in ("key", "value"):
                past.append(decoder["inputs"][f"past_{kind}_names"] % layer)
                present.append(decoder["outputs"][f"present_{kind}_names"] % layer)
        missing = [name for name in past if name not in names]
        if missing:
            raise UnsupportedGraph(f"the graph has no input {missing[0]}")
        logits = next(o for o in session.get_outputs() if o.name == "logits")
        return cls(
            past,
            present,
            decoder["num_key_value_heads"],
            decoder["head_size"],
            logits.shape[-1],
            position_ids if position_ids in names else None,
        )


def open_session(
    model_dir: Path, threads: int = 0, graph: bytes | None = None
) -> tuple[ort.InferenceSession, Layout]:
    """The folder's decoder on CPU, or `graph` (the decoder rewritten for adapters, lora_graph.py) with
    the folder's weights. Its threads sleep between runs rather than spin: spinning threads slowed a step
    2-3x on 2 busy cores."""
    config = read_genai(model_dir)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    model: str | bytes = str(model_dir / config["model"]["decoder"]["filename"])
    if graph is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(model_dir)
        )
        model = graph
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return session, Layout.read(model_dir, session)


class DecoderGraph:
    """Runs the decoder on KV slots: `run(input_ids, mask, slots, kv)` with kv the OrtValues of the
    consecutive slots [start, stop) (KvSlots.values), bound as both past and present; returns the logits
    [rows, tokens, vocab]. A range's binding is made once and kept. With `adapters` (a graph rewritten for
    them), `run` takes each row's adapter (None: the base model); the weights of the adapters' layout the
    run takes (lora.py's AdapterSet) stay bound until a run of the range takes another."""

    def __init__(
        self, session: ort.InferenceSession, layout: Layout, adapters: AdapterSet | None = None
    ) -> None:
        self.session, self.layout, self.adapters = session, layout, adapters
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._columns: dict[tuple[int, int], Columns] = {}  # the adapters' layout each binding holds

    def run(
        self,
        input_ids: np.ndarray,
        mask: np.ndarray,
        slots: tuple[int, int],
        kv: Sequence[ort.OrtValue],
        adapters: Sequence[str | None] = (),
    ) -> np.ndarray:
        binding = self._bindings.get(slots)
        if binding is None:
            binding = self._bindings[slots] = self.session.io_binding()
            for past, present, value in zip(
                self.layout.past_names, self.layout.present_names, kv, strict=True
            ):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
        binding.bind_cpu_input("input_ids", input_ids)
        if self.adapters is not None:
            rows = adapters or [None] * len(input_ids)
            columns = self.adapters.layout(rows)
            if self._columns.get(slots) is not columns:  # another layout than this binding's last run's
                self._columns[slots] = columns
                columns.bind(binding)
            row_scale = columns.row_scale(rows)
            binding.bind_cpu_input(ROW_SCALE, row_scale)
        binding.bind_cpu_input("attention_mask", mask)
        if self.layout.position_ids is not None:
            binding.bind_cpu_input(self.layout.position_ids, positions(mask, input_ids.shape[1]))
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        logits: np.ndarray = binding.get_outputs()[-1].numpy()
        return logits

    def forget(self) -> None:
        """Drops the bindings (the KV buffers they hold are being replaced)."""
        self._bindings.clear()
        self._columns.clear()


def positions(mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """Each row's positions of its ``new_tokens`` tokens, the last ones its mask covers."""
    ends = mask.sum(axis=1, keepdims=True)
    return np.asarray(ends - new_tokens + np.arange(new_tokens), np.int64)
