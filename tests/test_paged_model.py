"""The paged CUDA model's inputs for one run (worker/engines/paged/model.py): packed rows, their block
tables and the bounds the kernel reads on the host. The run itself needs a card
(`python -m ortfleet.bench.paged_model`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from worker.engines.device_sampling.rows import RowGather
from worker.engines.paged.model import PackedRow, PagedShape, by_row, pack

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
    assert feeds["taken"].tolist() == [2, 4, 5]  # each row's last token: the logits that come back
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

    logits = np.random.default_rng(0).standard_normal((7, 50)).astype(np.float16)
    gather = RowGather(["CPUExecutionProvider"])
    taken = gather.take(ort.OrtValue.ortvalue_from_numpy(logits), np.array([2, 4, 6]))
    assert taken.dtype == np.float32 and taken.shape == (3, 50)
    np.testing.assert_array_equal(taken, logits[[2, 4, 6]].astype(np.float32))


def test_a_row_that_asks_for_all_its_logits_gets_each_of_its_tokens_and_the_others_their_last() -> None:
    rows = [
        PackedRow([11, 12, 13], 4, [5, 9], all_logits=True),  # a prompt chunk with a past, every position
        PackedRow([21, 22], 0, [2]),  # a whole short prompt: its last token only
        PackedRow([31], 9, [0, 1, 3]),  # a decoding row
        PackedRow([41, 42], 0, [4], all_logits=True),
    ]
    feeds = pack(rows, block_size=4)
    assert feeds["taken"].tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert [row.returned for row in rows] == [3, 1, 1, 2]
    logits = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    parts = by_row(rows, logits)
    assert [part.tolist() for part in parts] == [
        logits[0:3].tolist(),
        logits[3:4].tolist(),
        logits[4:5].tolist(),
        logits[5:7].tolist(),
    ]
    with pytest.raises(ValueError, match="7 rows of logits for rows that take 6"):
        by_row([*rows[:3], PackedRow([41], 0, [4], all_logits=True)], logits)


def test_the_gather_takes_any_rows_in_any_order_from_fp16_logits_on_the_cpu_provider() -> None:
    import onnxruntime as ort

    logits = np.random.default_rng(1).standard_normal((8, 40)).astype(np.float16)
    gather = RowGather(["CPUExecutionProvider"])
    index = np.array([6, 0, 3, 3, 7, 1])  # unsorted, one twice
    taken = gather.take(ort.OrtValue.ortvalue_from_numpy(logits), index)
    np.testing.assert_array_equal(taken, logits[index].astype(np.float32))
    rows = [
        PackedRow([1, 2, 3], 0, [0], all_logits=True),
        PackedRow([4], 5, [1, 2]),
        PackedRow([5] * 4, 2, [3, 4], all_logits=True),
    ]
    feeds = pack(rows, block_size=4)  # what PagedModel.returned_logits gathers: 3, 1 and 4 of the run's 8
    parts = by_row(rows, gather.take(ort.OrtValue.ortvalue_from_numpy(logits), feeds["taken"]))
    np.testing.assert_array_equal(parts[0], logits[0:3].astype(np.float32))
    np.testing.assert_array_equal(parts[1], logits[3:4].astype(np.float32))
    np.testing.assert_array_equal(parts[2], logits[4:8].astype(np.float32))
