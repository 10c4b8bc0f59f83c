"""The paged model's CUDA graph buckets (worker/engines/paged/decode_graphs.py) on the CPU: which runs are
captured, the buckets they land in, the bucket-wide attention bounds, and a padded run's arrays against the
unpadded run's through the numpy reference (reference.py): the same logits for the real rows, and padding
rows that write only the scratch block. The graphs themselves need a card (tests/test_gpu_paged_graphs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.worker_settings import WorkerSettings
from worker.engines import engine_choice
from worker.engines.device import Device
from worker.engines.paged.decode_graphs import (
    Bucket,
    bucket_metadata,
    bucket_of,
    pad,
    rows_bucket,
    width_bucket,
)
from worker.engines.paged.model import MAX_ROWS, PackedRow, is_pure_decode, pack, pack_bucket
from worker.engines.paged.reference import ReferencePagedModel

pytestmark = pytest.mark.unit

BLOCK = 4


def test_rows_are_padded_to_the_next_power_of_two_up_to_the_operators_limit() -> None:
    assert [rows_bucket(n) for n in (1, 2, 3, 5, 17, 128, 129, 255, 256)] == [
        1,
        2,
        4,
        8,
        32,
        128,
        256,
        256,
        256,
    ]
    for refused in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="1 to 256 rows"):
            rows_bucket(refused)


def test_a_table_is_widened_to_a_power_of_two_from_eight_columns_or_to_the_whole_context() -> None:
    assert [width_bucket(n, 64) for n in (1, 8, 9, 16, 17, 33, 64)] == [8, 8, 16, 16, 32, 64, 64]
    assert [width_bucket(n, 12) for n in (1, 8, 9, 12)] == [
        8,
        8,
        12,
        12,
    ]  # the last bucket cut to the context
    assert width_bucket(3, 5) == 5  # a context narrower than eight blocks: one width
    with pytest.raises(ValueError, match="1 to 12 blocks"):
        width_bucket(13, 12)


def test_only_decoding_rows_without_adapters_are_captured() -> None:
    decode = PackedRow([5], 3, [0])
    assert is_pure_decode([decode, PackedRow([6], 9, [1, 2, 3])])
    assert not is_pure_decode([decode, PackedRow([1, 2], 3, [1, 2])])  # a prompt chunk
    assert not is_pure_decode([PackedRow([1], 0, [1])])  # a prompt of one token: no past
    assert not is_pure_decode([decode, PackedRow([6], 9, [1, 2, 3], adapter="a")])
    assert not is_pure_decode([])
    assert not is_pure_decode([decode] * (MAX_ROWS + 1))


def test_each_bucket_has_a_graph_id_of_its_own_and_onnxruntimes_are_never_used() -> None:
    buckets = [Bucket(rows, width) for rows in (1, 2, 4, 256) for width in (8, 12, 16, 512)]
    ids = [bucket.graph_id for bucket in buckets]
    assert len(set(ids)) == len(ids) and min(ids) > 0  # -1 runs eagerly, 0 is onnxruntime's default


def test_the_bucket_bounds_hold_for_every_run_the_bucket_takes() -> None:
    assert bucket_metadata(8, 16).tolist() == [1, 128, 1]  # the narrowest: no lower bound
    assert bucket_metadata(16, 16).tolist() == [1, 256, 8 * 16 + 1]
    assert bucket_metadata(12, 16).tolist() == [1, 192, 8 * 16 + 1]  # a width cut to the context
    for longest in range(1, 40 * BLOCK + 1):  # a run whose longest row has `longest` tokens
        rows = [PackedRow([1], longest - 1, list(range(-(-longest // BLOCK))))]
        bucket = bucket_of(pack(rows, BLOCK), most=40)
        metadata = bucket_metadata(bucket.width, BLOCK)
        assert metadata[2] <= longest <= metadata[1], (longest, bucket)


def rows_of(feeds: dict[str, np.ndarray]) -> list[PackedRow]:
    """The rows a run's arrays describe (pack's inverse): each row's tokens, past and the blocks its
    tokens reach, for the reference to run a run's arrays."""
    cumulative = feeds["cumulative_sequence_lengths"].tolist()
    ids = feeds["input_ids"].tolist()
    rows = []
    for index, past in enumerate(feeds["past_sequence_lengths"].tolist()):
        tokens = ids[cumulative[index] : cumulative[index + 1]]
        used = -(-(past + len(tokens)) // BLOCK)
        rows.append(PackedRow(tokens, past, feeds["block_table"][index, :used].tolist()))
    return rows


def reference_pair(blocks: int) -> tuple[ReferencePagedModel, ReferencePagedModel]:
    """Two reference models of the same weights, each with a scratch block (`blocks`) past the others."""
    return ReferencePagedModel(blocks + 1, BLOCK, seed=3), ReferencePagedModel(blocks + 1, BLOCK, seed=3)


def run_arrays(model: ReferencePagedModel, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The reference run of a run's arrays: every row's logits, then those `taken` names."""
    logits = model.returned_logits(rows_of(feeds))
    taken: np.ndarray = logits[feeds["taken"]]
    return taken


@pytest.mark.parametrize("count", [1, 3, 5, 17])
def test_a_padded_run_gives_the_real_rows_the_unpadded_runs_logits_and_writes_only_the_scratch_block(
    count: int,
) -> None:
    blocks = scratch = 12 * count
    plain, padded = reference_pair(blocks)
    rng = np.random.default_rng(count)
    prompts = [rng.integers(1, 97, size=int(rng.integers(25, 8 * BLOCK))).tolist() for _ in range(count)]
    tables = [list(range(12 * r, 12 * r + 12)) for r in range(count)]  # 48 tokens a row at most
    prefill = [PackedRow(prompt, 0, table) for prompt, table in zip(prompts, tables, strict=True)]
    for model in (plain, padded):  # the prompts, eagerly, in both
        model.returned_logits(prefill)
    generated = [[int(rng.integers(1, 97))] for _ in range(count)]
    widths_seen = set()
    for _ in range(2 * BLOCK + 1):  # decodes past 32 tokens: out of the narrowest bucket (8 blocks)
        rows = [
            PackedRow([ids[-1]], len(prompt) + len(ids) - 1, table)
            for prompt, ids, table in zip(prompts, generated, tables, strict=True)
        ]
        feeds = pack_bucket(rows, BLOCK, 12, scratch)
        bucket = Bucket(len(feeds["past_sequence_lengths"]), feeds["block_table"].shape[1])
        widths_seen.add(bucket.width)
        assert len(feeds["past_sequence_lengths"]) == bucket.rows == rows_bucket(count)
        assert feeds["block_table"].shape == (bucket.rows, bucket.width)
        assert feeds["taken"].tolist() == list(range(count))  # the real rows, first
        ours = run_arrays(padded, feeds)
        theirs = run_arrays(plain, pack(rows, BLOCK))
        np.testing.assert_array_equal(ours, theirs)
        for ids, row_logits in zip(generated, ours, strict=True):
            ids.append(int(row_logits.argmax()))
    assert widths_seen == {8, 12}  # 12: the second width, cut to a 48-token context
    slots = slice(scratch * BLOCK, (scratch + 1) * BLOCK)
    assert np.isnan(plain.pool[:, :, slots]).all()  # the unpadded runs never touched the scratch block
    if rows_bucket(count) > count:  # padding rows wrote their one token's slot there, nothing else
        assert not np.isnan(padded.pool[:, :, scratch * BLOCK]).any()
        assert np.isnan(padded.pool[:, :, scratch * BLOCK + 1 : (scratch + 1) * BLOCK]).all()
    outside = np.ones(padded.pool.shape[2], bool)
    outside[slots] = False
    np.testing.assert_array_equal(
        padded.pool[:, :, outside], plain.pool[:, :, outside]
    )  # NaN where unwritten


def test_a_padded_run_crosses_width_buckets_as_its_longest_row_grows() -> None:
    blocks = 40
    plain, padded = reference_pair(blocks)
    long_prompt = list(range(1, 8 * BLOCK + 1))  # 32 tokens: eight blocks, the narrowest bucket full
    short_prompt = [7, 8, 9]
    tables = [list(range(0, 12)), list(range(12, 14))]
    for model in (plain, padded):
        model.returned_logits([PackedRow(long_prompt, 0, tables[0]), PackedRow(short_prompt, 0, tables[1])])
    rows = [PackedRow([3], len(long_prompt), tables[0]), PackedRow([4], len(short_prompt), tables[1])]
    assert bucket_of(pack(rows, BLOCK), most=12) == Bucket(2, 12)  # 9 blocks: past 8, cut to the context's 12
    feeds = pack_bucket(rows, BLOCK, 12, scratch=blocks)
    assert feeds["attention_metadata"].tolist() == [1, 12 * BLOCK, 8 * BLOCK + 1]
    np.testing.assert_array_equal(run_arrays(padded, feeds), run_arrays(plain, pack(rows, BLOCK)))
    assert feeds["block_table"][0].tolist() == [*tables[0][:9], 0, 0, 0]
    assert feeds["block_table"][1].tolist() == [12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_a_run_the_bucket_cannot_hold_is_refused_by_name() -> None:
    feeds = pack([PackedRow([1], 40, list(range(11)))], BLOCK)
    with pytest.raises(ValueError, match="a run of 1 rows of 11 blocks does not fit"):
        pad(feeds, Bucket(1, 8), BLOCK, scratch=50)
    with pytest.raises(ValueError, match="a run of 3 rows of 1 blocks does not fit"):
        pad(pack([PackedRow([1], 2, [0])] * 3, BLOCK), Bucket(2, 8), BLOCK, scratch=50)
    with pytest.raises(ValueError, match="one token a row"):
        pad(pack([PackedRow([1, 2], 2, [0])], BLOCK), Bucket(1, 8), BLOCK, scratch=50)
    with pytest.raises(ValueError, match="only a run of decoding rows"):
        pack_bucket([PackedRow([1, 2], 2, [0])], BLOCK, 8, scratch=50)
    with pytest.raises(ValueError, match="1 to 12 blocks here, not 13"):
        pack_bucket([PackedRow([1], 50, list(range(13)))], BLOCK, 12, scratch=50)


def test_the_arrays_of_a_run_give_back_its_rows() -> None:
    rows = [PackedRow([11, 12, 13], 4, [5, 9]), PackedRow([21, 22], 0, [2]), PackedRow([31], 9, [0, 1, 3])]
    assert rows_of(pack(rows, BLOCK)) == rows


@pytest.mark.parametrize(("setting", "captures"), [("auto", True), ("on", True), ("off", False)])
def test_the_paged_engine_on_a_card_captures_cuda_graphs_unless_the_setting_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, captures: bool
) -> None:
    from tests.test_engine_choice import model
    from worker.engines import row_sizing
    from worker.engines.paged import engine
    from worker.engines.paged import model as paged_model

    made: dict[str, Any] = {}
    monkeypatch.setattr(row_sizing, "gpu_memory", lambda label: (80 * 2**30, 40 * 2**30))
    monkeypatch.setattr(paged_model, "PagedModel", lambda *args, **kwargs: made.setdefault("model", kwargs))
    monkeypatch.setattr(engine, "PagedEngine", lambda model_dir, runner, *_, **__: runner())
    settings = WorkerSettings(scheduler="paged", cuda_graph=setting)  # type: ignore[arg-type]
    engine_choice.open_engine(model(tmp_path, paged=True), Device("cuda", 0), settings)
    assert made["model"]["cuda_graph"] is captures


class FakeGraphs:
    """DecodeGraphs' side of a run, recorded: the padded arrays each bucket was run with."""

    def __init__(self, failing: bool = False) -> None:
        self.failing = failing
        self.seen: list[tuple[Bucket, dict[str, np.ndarray]]] = []
        self.done: set[Bucket] = set()

    def bucket(self, feeds: dict[str, np.ndarray]) -> Bucket | None:
        return bucket_of(feeds, 12) if feeds["block_table"].shape[1] <= 12 else None

    def captured(self, bucket: Bucket) -> bool:
        return bucket in self.done

    def run(self, feeds: dict[str, np.ndarray], bucket: Bucket) -> str:
        self.seen.append((bucket, feeds))
        if self.failing:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")
        self.done.add(bucket)
        return "graph logits"


def routed_model(graphs: FakeGraphs, adapters: object = None) -> Any:
    """A PagedModel without a card: its graphs faked, its eager runs recorded."""
    from worker.engines.paged.model import PagedModel

    model = PagedModel.__new__(PagedModel)
    model.block_size, model.blocks, model.adapters = BLOCK, 40, adapters  # block 40: the scratch one
    model.graphs = graphs  # type: ignore[assignment]
    model.eager_runs = []  # type: ignore[attr-defined]

    def eager_run(rows: list[PackedRow]) -> tuple[str, np.ndarray]:
        model.eager_runs.append(rows)  # type: ignore[attr-defined]
        return "eager logits", pack(rows, BLOCK)["taken"]

    model._eager_run = eager_run  # type: ignore[method-assign]
    return model


def test_a_pure_decode_run_replays_its_buckets_graph_and_the_other_runs_are_eager() -> None:
    graphs = FakeGraphs()
    model = routed_model(graphs)
    decodes = [PackedRow([5], 3, [0]), PackedRow([6], 9, [1, 2, 3])]
    logits, taken = model.run(decodes)
    assert logits == "graph logits" and taken.tolist() == [0, 1]
    [(bucket, feeds)] = graphs.seen
    assert bucket == Bucket(2, 8) and feeds["block_table"][1, :3].tolist() == [1, 2, 3]
    three = [*decodes, PackedRow([7], 1, [4])]
    model.run(three)
    assert graphs.seen[-1][0] == Bucket(4, 8)
    assert graphs.seen[-1][1]["block_table"][3, 0] == 40  # the padding row writes the scratch block
    chunk = [PackedRow([1, 2, 3], 0, [9])]
    long_row = [PackedRow([1], 12 * BLOCK, list(range(13)))]  # past the widest bucket
    for eager in (chunk, [*decodes, *chunk], long_row):
        assert model.run(eager)[0] == "eager logits"
    assert model.eager_runs == [chunk, [*decodes, *chunk], long_row] and len(graphs.seen) == 2
    with_adapters = routed_model(FakeGraphs(), adapters=object())  # a graph rewritten for LoRA adapters
    assert with_adapters.run(decodes)[0] == "eager logits"


def test_a_failed_capture_runs_eagerly_from_then_on_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    graphs = FakeGraphs(failing=True)
    model = routed_model(graphs)
    decodes = [PackedRow([5], 3, [0])]
    with caplog.at_level("WARNING"):
        assert model.run(decodes)[0] == "eager logits"  # the same run, again, eagerly
    assert model.graphs is None and model.eager_runs == [decodes]
    assert "capturing a CUDA graph failed (cudaErrorStreamCaptureUnsupported)" in caplog.text
    assert model.run(decodes)[0] == "eager logits" and len(graphs.seen) == 1


def test_a_replay_that_fails_fails_its_run() -> None:
    graphs = FakeGraphs()
    model = routed_model(graphs)
    decodes = [PackedRow([5], 3, [0])]
    model.run(decodes)
    graphs.failing = True
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
        model.run(decodes)  # the engine fails the run's rows and restarts with a fresh model
    assert model.graphs is graphs
