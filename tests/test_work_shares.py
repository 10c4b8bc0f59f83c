"""Keys' shares of the engine's work (worker/engines/work_shares.py), alone and in the paged scheduler:
a key's prompts wait while it has used more engine time than a key that only decodes, newcomers start
level with the keys holding rows, and a key away between two short requests keeps what it used."""

from __future__ import annotations

import pytest

from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.scheduler import PagedRow, Scheduler
from worker.engines.work_shares import Chunk, WorkShares

pytestmark = pytest.mark.unit


def _prompt(owner: str, tokens: int = 100, weight: float = 1.0) -> Chunk[str]:
    return Chunk(owner, owner, weight, tokens, tokens)


def test_a_chunk_waits_until_the_decoding_keys_are_as_far_ahead_as_it_costs() -> None:
    shares = WorkShares()
    shares.ran_prefill(100, 0.5)  # a 100-token chunk costs 0.5 s, a decode step 1/16 s
    shares.ran_decode(1, 0.0625)
    shares.hold({"flood", "chat"})
    flood = _prompt("flood")
    steps = 0
    while shares.next_chunk([flood], {"chat": 1.0}) is None:
        shares.charge("chat", 1.0, 0.0625)  # the chat's decode steps
        steps += 1
    assert steps == 7  # its finish (0.5) is no later than the chat's next step's (7 steps and one more)
    shares.charge("flood", 1.0, 0.5)
    assert shares.next_chunk([flood], {"chat": 1.0}) is None  # and then it waits again


def test_a_key_alone_is_never_held_back() -> None:
    shares = WorkShares()
    shares.ran_prefill(100, 0.1)
    for _ in range(5):
        shares.hold({"only"})
        assert shares.next_chunk([_prompt("only")], {"only": 1.0}) is not None
        shares.charge("only", 1.0, 0.5)


def test_prompts_of_keys_that_only_prefill_take_turns_by_finish() -> None:
    shares = WorkShares()
    shares.ran_prefill(100, 0.1)
    shares.hold({"a", "b"})
    first = shares.next_chunk([_prompt("a", 100), _prompt("b", 20)], {})
    assert first is not None and first.owner == "b"  # the cheaper chunk finishes first
    shares.charge("b", 1.0, 0.2)
    second = shares.next_chunk([_prompt("a", 100), _prompt("b", 20)], {})
    assert second is not None and second.owner == "a"


def test_a_newcomer_starts_level_with_the_keys_holding_rows_and_banks_no_idle_credit() -> None:
    shares = WorkShares()
    shares.hold({"a"})
    shares.charge("a", 1.0, 3.0)
    shares.hold({"a", "b"})
    assert shares.used("b") == shares.used("a") == 3.0
    shares.charge("b", 1.0, 1.0)
    shares.hold({"a"})  # b away; it used more than a, so it keeps that
    shares.charge("a", 1.0, 0.5)
    shares.hold({"a", "b"})
    assert shares.used("b") == 4.0 and shares.next_chunk([_prompt("b")], {"a": 1.0}) is None


def test_a_key_away_between_two_short_requests_keeps_its_count() -> None:
    shares = WorkShares()
    shares.hold({"flood", "chat"})
    shares.charge("flood", 1.0, 0.1)
    shares.hold({"chat"})  # the flood's request ended with its first token; the next is on its way
    shares.hold({"chat", "flood"})
    assert shares.next_chunk([_prompt("flood")], {"chat": 1.0}) is None


def test_weights_divide_what_a_key_is_charged() -> None:
    shares = WorkShares()
    shares.hold({"heavy", "light"})
    shares.charge("heavy", 2.0, 0.2)
    shares.charge("light", 1.0, 0.1)
    assert shares.used("heavy") == pytest.approx(shares.used("light"))


def test_nobody_holding_a_row_clears_the_ledger() -> None:
    shares = WorkShares()
    shares.hold({"a"})
    shares.charge("a", 1.0, 9.0)
    shares.hold(set())
    shares.hold({"b"})
    assert shares.used("b") == 0.0 and shares.used("a") == 0.0


def test_the_paged_scheduler_plans_no_chunk_for_a_key_ahead_of_one_that_decodes() -> None:
    scheduler = Scheduler(BlockManager(64, 8), capacity=4, prefill_chunk=16)
    chat = PagedRow(list(range(1, 9)), 20, owner="chat")
    scheduler.submit(chat)
    planned = scheduler.plan()
    scheduler.advance(planned)
    chat.generated.append(3)
    flood = PagedRow(list(range(10, 40)), 1, owner="flood")
    scheduler.submit(flood)
    scheduler.shares.charge("flood", 1.0, 1.0)  # what its earlier prompts cost
    planned = scheduler.plan()
    assert [plan.row.owner for plan in planned] == ["chat"]  # the chat decodes, the flood's prompt waits
    scheduler.advance(planned)
    chat.generated.append(4)
    scheduler.shares.charge("chat", 1.0, 1.5)
    planned = scheduler.plan()
    assert [plan.row.owner for plan in planned] == ["chat", "flood"]
