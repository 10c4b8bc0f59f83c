"""The paged CUDA model's inputs for one run (worker/engines/paged/model.py): packed rows, their block
tables and the bounds the kernel reads on the host. The run itself needs a card
(`python -m ortfleet.bench.paged_model`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from worker.engines.paged.model import PackedRow, PagedShape, pack

pytestmark = pytest.mark.unit


def test_a_mixed_run_packs_a_chunk_a_prefill_and_a_decode_one_after_another() -> None:
    feeds = pack(
        [
            PackedRow([11, 12, 13], 4, [5, 9]),  # a prompt's second chunk: tokens 4..6, over two blocks of 4
            PackedRow([21, 22], 0, [2]),  # a whole short prompt
            PackedRow([31], 9, [0, 1, 3]),  # a decoding row's tenth token
        ],
        block_size=4,
    )
    assert feeds["input_ids"].tolist() == [11, 12, 13, 21, 22, 31]
    assert feeds["input_ids"].dtype == np.int64
    assert feeds["cumulative_sequence_lengths"].tolist() == [0, 3, 5, 6]
    assert feeds["past_sequence_lengths"].tolist() == [4, 0, 9]
    assert feeds["block_table"].tolist() == [[5, 9, 0], [2, 0, 0], [0, 1, 3]]
    assert feeds["attention_metadata"].tolist() == [3, 10, 0]  # longest chunk, longest row, no lower bound
    assert feeds["last"].tolist() == [2, 4, 5]
    for name in ("cumulative_sequence_lengths", "past_sequence_lengths", "block_table", "attention_metadata"):
        assert feeds[name].dtype == np.int32, name


def test_a_table_is_cut_to_the_blocks_the_run_reaches() -> None:
    feeds = pack([PackedRow([1], 3, [7, 8, 9])], block_size=4)  # reserved three blocks, uses one
    assert feeds["block_table"].tolist() == [[7]]


def test_a_row_whose_table_is_short_or_whose_run_is_empty_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="row 1 needs 2 blocks of 4 for 5 tokens, its table holds 1"):
        pack([PackedRow([1], 0, [0]), PackedRow([1, 2], 3, [1])], block_size=4)
    with pytest.raises(ValueError, match="row 0 has no token"):
        pack([PackedRow([], 3, [1])], block_size=4)
    with pytest.raises(ValueError, match="at least one row"):
        pack([], block_size=4)


def test_the_shape_of_a_paged_folder_and_the_refusal_of_another(tmp_path) -> None:  # type: ignore[no-untyped-def]
    decoder = {
        "num_hidden_layers": 30, "num_key_value_heads": 3, "head_size": 64, "filename": "model.onnx",
        "inputs": {"block_table": "block_table", "past_key_names": "past_key_values.%d.key"},
        "outputs": {"logits": "logits"},
    }  # fmt: skip
    model = {"decoder": decoder, "eos_token_id": [2, 0], "vocab_size": 49152, "context_length": 8192}
    config = {"model": model}
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    shape = PagedShape.of(tmp_path)
    assert (shape.layers, shape.kv_heads, shape.head_size, shape.eos) == (30, 3, 64, frozenset({0, 2}))
    assert shape.block_bytes(256) == 2 * 30 * 256 * 3 * 64 * 2
    decoder["inputs"] = {"attention_mask": "attention_mask"}
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not built with paged attention"):
        PagedShape.of(tmp_path)


def test_the_last_rows_of_a_runs_logits_come_back_as_float32() -> None:
    import onnxruntime as ort

    from worker.engines.paged.model import LastRows

    logits = np.random.default_rng(0).standard_normal((7, 50)).astype(np.float16)
    taken = LastRows().take(ort.OrtValue.ortvalue_from_numpy(logits), np.array([2, 4, 6]))
    assert taken.dtype == np.float32 and taken.shape == (3, 50)
    np.testing.assert_array_equal(taken, logits[[2, 4, 6]].astype(np.float32))
