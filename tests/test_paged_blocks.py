"""The paged KV cache's block manager (worker/engines/paged/blocks.py): reservations that a running row
never outgrows, prefix reuse by whole blocks within a scope, the cache's fair eviction, and books that
balance through thousands of random admissions, growths and releases."""

from __future__ import annotations

import random

import pytest

from worker.engines.paged.blocks import BlockManager, OutOfBlocks

pytestmark = pytest.mark.unit

B = 16  # tokens a block


def prompt(length: int, start: int = 1000) -> list[int]:
    return list(range(start, start + length))


def run_prefill(manager: BlockManager, row: int, tokens: list[int], reused: int) -> None:
    manager.grow(row, len(tokens) - reused)
    manager.computed(row, len(tokens))


def test_a_row_reserves_its_whole_length_and_grows_into_it_without_running_out() -> None:
    manager = BlockManager(10, B)
    assert manager.admit(1, prompt(40), 40) == 0  # 80 tokens: 5 blocks
    assert manager.available == 5
    table = manager.grow(1, 40)
    assert len(table) == 3 and len(set(table)) == 3
    for _ in range(40):
        manager.grow(1, 1)
    assert len(manager.table(1)) == 5 and manager.available == 5
    with pytest.raises(OutOfBlocks, match="past its reservation"):
        manager.grow(1, 1)
    manager.check()


def test_a_row_the_pool_cannot_hold_whole_is_refused_until_another_ends() -> None:
    manager = BlockManager(8, B)
    manager.admit(1, prompt(60), 40)  # 7 blocks
    assert not manager.fits(prompt(20), 20, "")  # 3 blocks: 1 left
    with pytest.raises(OutOfBlocks, match="needs 3 new blocks"):
        manager.admit(2, prompt(20), 20)
    manager.release(1)
    assert manager.fits(prompt(20), 20, "") and manager.admit(2, prompt(20), 20) == 0
    manager.check()


def test_a_prompt_of_the_same_scope_reuses_whole_computed_blocks_short_of_its_last_token() -> None:
    manager = BlockManager(32, B)
    first = prompt(50)  # 3 whole blocks
    manager.admit(1, first, 10, "key-a")
    run_prefill(manager, 1, first, 0)
    assert manager.cached_blocks == 3
    # The same prompt: only 3 whole blocks, but its last token must be computed: 3 blocks reused (48 < 50).
    assert manager.admit(2, first, 10, "key-a") == 48
    assert manager.table(2) == manager.table(1)[:3]  # shared, not copied
    # A prompt of exactly 48 tokens reuses 2 blocks: the third would hold its last token.
    assert manager.admit(3, first[:48], 10, "key-a") == 32
    # Another scope reuses nothing, however alike its prompt.
    assert manager.admit(4, first, 10, "key-b") == 0
    # A prompt that differs inside the second block reuses the first alone.
    other = [*first[:20], 7, *first[21:]]
    assert manager.admit(5, other, 10, "key-a") == 16
    manager.check()


def test_a_cached_block_outlives_its_rows_until_a_row_needs_room() -> None:
    manager = BlockManager(6, B)
    shared = prompt(33)  # 2 whole blocks, then 1 token
    manager.admit(1, shared, 15)  # 3 blocks
    run_prefill(manager, 1, shared, 0)
    manager.release(1)
    assert manager.cached_blocks == 2 and manager.available == 6  # idle cached blocks count as room
    assert manager.admit(2, shared, 15) == 32  # taken back from the cache
    manager.release(2)
    manager.admit(3, prompt(90, start=5000), 6)  # 6 blocks: the cache's 2 are evicted for it
    manager.grow(3, 96)
    assert manager.cached_blocks == 0
    manager.check()


def test_eviction_takes_from_the_scope_that_keeps_the_most_then_its_least_recently_used() -> None:
    manager = BlockManager(7, B)
    # small's block is the oldest: plain LRU would evict it first.
    for row, (scope, start, length) in enumerate([("small", 900, 17), ("big", 0, 49), ("big", 500, 17)]):
        tokens = prompt(length, start)
        manager.admit(row, tokens, 0, scope)
        run_prefill(manager, row, tokens, 0)
        manager.release(row)
    # Cached: big holds 3 + 1 blocks, small 1; 7 - 5 = 2 empty (the rows' partial blocks were freed).
    assert manager.cached_blocks == 5
    manager.admit(10, prompt(64, 3000), 0, "small")  # 4 blocks: 2 empty, then 2 evicted
    manager.grow(10, 64)
    # big's blocks went (its oldest, the 49-token prompt's first), small's stayed.
    assert manager.admit(11, prompt(17, 900), 0, "small") == 16
    manager.release(10)
    manager.release(11)
    assert manager.admit(12, prompt(49, 0), 0, "big") == 0  # its chain starts with an evicted block
    manager.check()


def test_the_books_balance_through_random_admissions_growths_computations_and_releases() -> None:
    rng = random.Random(7)
    manager = BlockManager(64, 8)
    prompts = [prompt(rng.randint(1, 60), start=rng.choice([0, 0, 100, 200])) for _ in range(30)]
    running: dict[int, tuple[list[int], int, int]] = {}  # row -> (prompt, max new, tokens written)
    for row in range(5000):
        action = rng.random()
        if action < 0.4:
            tokens, new = rng.choice(prompts), rng.randint(0, 30)
            scope = rng.choice(["a", "b"])
            if manager.fits(tokens, new, scope):
                reused = manager.admit(row, tokens, new, scope)
                assert reused % 8 == 0 and reused < len(tokens)
                running[row] = (tokens, new, reused)
            else:
                with pytest.raises(OutOfBlocks):
                    manager.admit(row, tokens, new, scope)
        elif action < 0.8 and running:
            row = rng.choice(list(running))
            tokens, new, written = running[row]
            length = len(tokens) + new
            step = min(length - written, rng.randint(1, 20))
            if step:
                manager.grow(row, step)
                written += step
                manager.computed(row, min(written, len(tokens)))
                running[row] = (tokens, new, written)
            assert len(manager.table(row)) * 8 >= written
        elif running:
            gone = rng.choice(list(running))
            del running[gone]
            manager.release(gone)
        manager.check()
    for row in list(running):
        manager.release(row)
    manager.check()
    assert manager.available == 64
