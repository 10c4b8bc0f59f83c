"""The paged engine's scheduler (worker/engines/paged/scheduler.py) over its block manager, run against the
paged model's contract computed on the host (worker/engines/paged/reference.py): in batches that mix
decodes and prompt chunks, with prefix reuse and rows ended mid-way, every row's greedy tokens are the
ones it gets alone, and the pool's books balance after every step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.model import PackedRow, by_row
from worker.engines.paged.reference import ReferencePagedModel
from worker.engines.paged.scheduler import PagedRow, Planned, Scheduler

pytestmark = pytest.mark.unit

BLOCK = 8


def run(
    scheduler: Scheduler,
    model: ReferencePagedModel,
    rows: list[PagedRow],
    on_step: Callable[[int, list[Planned]], None] = lambda step, planned: None,
) -> int:
    """Greedy steps until every row is done; the steps it took."""
    for row in rows:
        scheduler.submit(row)
    step = 0
    while any(True for _ in scheduler.rows()):
        planned = scheduler.plan()
        assert planned, "rows wait but nothing runs"
        logits = model.returned_logits([p.packed for p in planned])
        scheduler.advance(planned)
        for plan, row_logits in zip(planned, logits, strict=True):
            if plan.samples:
                plan.row.generated.append(int(np.argmax(row_logits)))
        for plan in planned:
            if plan.samples and len(plan.row.generated) >= plan.row.max_new_tokens:
                scheduler.end(plan.row)
        scheduler.blocks.check()
        on_step(step, planned)
        step += 1
    return step


def took(scheduler: Scheduler, planned: list[Planned], token: int = 1) -> None:
    scheduler.advance(planned)
    for plan in planned:
        if plan.samples:
            plan.row.generated.append(token)


def alone(row: PagedRow) -> list[int]:
    """The row's greedy tokens computed without the scheduler: its prompt in one run on blocks of its own
    in order, then one run a token."""
    table = list(range(-(-row.length // BLOCK)))
    model = ReferencePagedModel(len(table), BLOCK)
    tokens = [int(np.argmax(model.returned_logits([PackedRow(row.prompt, 0, table)])[0]))]
    while len(tokens) < row.max_new_tokens:
        past = len(row.prompt) + len(tokens) - 1
        tokens.append(int(np.argmax(model.returned_logits([PackedRow([tokens[-1]], past, table)])[0])))
    return tokens


def workload(rng: np.random.Generator, count: int) -> list[PagedRow]:
    """Prompts of 1 to 60 tokens, a third of them starting with one of two shared 20-token openings, in
    two scopes."""
    openings = [list(rng.integers(97, size=20)) for _ in range(2)]
    rows = []
    for _ in range(count):
        prompt = [int(t) for t in rng.integers(97, size=int(rng.integers(1, 41)))]
        if rng.random() < 0.35:
            prompt = [int(t) for t in openings[int(rng.integers(2))]] + prompt
        rows.append(PagedRow(prompt, int(rng.integers(1, 20)), scope=str(rng.integers(2))))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_rows_in_mixed_batches_with_chunks_and_reuse_get_their_tokens_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = workload(rng, 24)
    blocks = BlockManager(40, BLOCK)  # too few for every row at once: rows wait for blocks
    scheduler = Scheduler(blocks, capacity=6, prefill_chunk=16)
    seen_mixed = []

    def check(step: int, planned: list[Planned]) -> None:
        prefills = [p for p in planned if p.packed.past < len(p.row.prompt)]
        seen_mixed.append(bool(prefills) and len(prefills) < len(planned))
        assert (
            sum(len(p.packed.tokens) for p in prefills) < 2 * 16
        )  # a chunk's budget, and the last chunk begun
        for plan in prefills:  # chunks end at multiples of the chunk, or at the prompt's end
            end = plan.packed.past + len(plan.packed.tokens)
            assert end % 16 == 0 or end == len(plan.row.prompt)

    run(scheduler, ReferencePagedModel(blocks.blocks, BLOCK, seed=0), rows, check)
    for row in rows:
        assert row.generated == alone(row), row.prompt
    assert any(seen_mixed), "no step mixed decodes and prompt chunks"
    assert any(row.reused for row in rows), "no prompt reused a cached block"
    assert blocks.available == blocks.blocks  # every block back: empty or cached


def test_a_decoding_row_gets_a_token_every_step_while_a_long_prompt_prefills() -> None:
    blocks = BlockManager(64, BLOCK)
    scheduler = Scheduler(blocks, capacity=4, prefill_chunk=16)
    model = ReferencePagedModel(blocks.blocks, BLOCK)
    short = PagedRow([5, 6, 7], 30)
    scheduler.submit(short)
    for _ in range(2):
        planned = scheduler.plan()
        model.returned_logits([p.packed for p in planned])
        took(scheduler, planned)
    long = PagedRow(list(range(90)), 4)
    scheduler.submit(long)
    steps_while_prefilling = 0
    while not long.decoding:
        planned = scheduler.plan()
        model.returned_logits([p.packed for p in planned])
        assert [p.row for p in planned if p.row is short] == [short]  # the short row in every step
        chunk = next(p for p in planned if p.row is long)
        assert len(chunk.packed.tokens) <= 16
        took(scheduler, planned)
        steps_while_prefilling += 1
    assert steps_while_prefilling == 6  # 90 tokens in chunks of 16
    assert len(short.generated) == 2 + 6


def test_the_row_with_the_fewest_prompt_tokens_left_prefills_first_within_the_steps_budget() -> None:
    scheduler = Scheduler(BlockManager(64, BLOCK), capacity=4, prefill_chunk=16)
    long, short = PagedRow(list(range(100)), 2), PagedRow(list(range(10)), 2)
    tiny = PagedRow(list(range(6)), 2)
    scheduler.submit(long)
    scheduler.submit(short)
    scheduler.submit(tiny)
    planned = scheduler.plan()
    # the two short prompts whole (16 tokens: the step's budget); the long one's first chunk waits
    assert [p.row for p in planned] == [tiny, short]
    assert [p.samples for p in planned] == [True, True]
    took(scheduler, planned)  # each gets its first token
    planned = scheduler.plan()
    assert [p.row for p in planned] == [short, tiny, long]  # decodes in order of admission, then chunks
    assert [len(p.packed.tokens) for p in planned] == [1, 1, 16]


def test_a_row_waits_for_blocks_first_come_first_served_and_no_later_row_jumps_it() -> None:
    blocks = BlockManager(6, BLOCK)
    scheduler = Scheduler(blocks, capacity=4, prefill_chunk=64)
    first, big, small = PagedRow([1] * 20, 10), PagedRow([2] * 20, 10), PagedRow([3], 1)
    for row in (first, big, small):
        scheduler.submit(row)
    scheduler.plan()
    assert scheduler.running == [first] and list(scheduler.waiting) == [big, small]  # small would fit
    scheduler.end(first)
    scheduler.plan()
    assert scheduler.running == [big, small] and not scheduler.waiting


def test_a_row_ended_mid_prompt_gives_its_blocks_back_and_the_others_go_on_unchanged() -> None:
    rng = np.random.default_rng(7)
    rows = workload(rng, 10)
    blocks = BlockManager(48, BLOCK)
    scheduler = Scheduler(blocks, capacity=5, prefill_chunk=8)
    model = ReferencePagedModel(blocks.blocks, BLOCK)
    cancelled = rows[3]

    def cancel(step: int, planned: list[Planned]) -> None:
        if step == 2 and cancelled in scheduler.running:
            scheduler.end(cancelled)

    run(scheduler, model, rows, cancel)
    for row in rows:
        if row is not cancelled:
            assert row.generated == alone(row)
    assert blocks.available == blocks.blocks


def test_rows_share_cached_prompt_blocks_only_within_their_scope() -> None:
    opening = list(range(1, 33))  # four whole blocks
    blocks = BlockManager(32, BLOCK)
    scheduler = Scheduler(blocks, capacity=2, prefill_chunk=64)
    model = ReferencePagedModel(blocks.blocks, BLOCK)
    first = PagedRow([*opening, 40], 3, scope="a")
    run(scheduler, model, [first])
    same, other = PagedRow([*opening, 41, 42], 3, scope="a"), PagedRow([*opening, 41, 42], 3, scope="b")
    run(scheduler, model, [same, other])
    assert (first.reused, same.reused, other.reused) == (0, 32, 0)
    assert same.generated == other.generated == alone(same)


def test_a_row_that_can_never_fit_the_pool_is_refused_by_name() -> None:
    scheduler = Scheduler(BlockManager(4, BLOCK), capacity=2, prefill_chunk=16)
    with pytest.raises(
        ValueError, match=r"needs 5 blocks of 8 tokens \(30 prompt tokens and 10 to generate\)"
    ):
        scheduler.submit(PagedRow([1] * 30, 10))
    with pytest.raises(ValueError, match="at least one prompt token"):
        scheduler.submit(PagedRow([], 10))


def test_a_row_asking_for_all_its_logits_gets_every_prompt_positions_across_chunks_and_decodes_one() -> None:
    blocks = BlockManager(16, BLOCK)
    scheduler = Scheduler(blocks, capacity=2, prefill_chunk=16)
    model = ReferencePagedModel(blocks.blocks, BLOCK)
    asking, other = PagedRow(list(range(3, 43)), 3, all_logits=True), PagedRow(list(range(5, 12)), 3)
    for row in (asking, other):
        scheduler.submit(row)
    prompt_logits, chunks, decodes = [], [], 0
    while len(asking.generated) < asking.max_new_tokens:
        planned = scheduler.plan()
        packed = [p.packed for p in planned]
        logits = model.returned_logits(packed)
        assert len(logits) == sum(row.returned for row in packed)
        parts = by_row(packed, logits)
        for plan, part in zip(planned, parts, strict=True):
            if plan.row is asking and not asking.decoding:
                assert plan.packed.all_logits and len(part) == len(plan.packed.tokens)
                prompt_logits.extend(part)
                chunks.append(len(part))
            elif plan.row is asking:
                assert not plan.packed.all_logits and len(part) == 1
                decodes += 1
            else:
                assert not plan.packed.all_logits and len(part) == 1
        took(scheduler, planned)
    assert chunks == [16, 16, 8] and decodes == 2  # its prompt across three chunks, then two decodes
    table = list(range(-(-asking.length // BLOCK)))
    whole = ReferencePagedModel(len(table), BLOCK)
    for position, row_logits in enumerate(prompt_logits):  # each position's logits, as its prefix alone
        [expected] = whole.returned_logits([PackedRow(asking.prompt[: position + 1], 0, table)])
        np.testing.assert_allclose(row_logits, expected, rtol=1e-10, atol=1e-10)
