"""The step crossing between an engine core and a frontend (worker/core/): one step's output for a
frontend as arrays in one buffer, the frontend's commands, and the socketpair they cross."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket

import numpy as np
import pytest

from worker.core.channel import CoreEnd, FrontendEnd, channel_pair
from worker.core.commands import (
    Cancel,
    Command,
    CommandDecodeError,
    Stop,
    Submit,
    decode_command,
    encode_command,
)
from worker.core.step_wire import FINISH_CODES, LogprobBlock, Step, StepDecodeError, decode_step, encode_step
from worker.engine import Finish, GenerationRequest

ROWS = 256
CANCELLED_ROW = 7


def arange(count: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.int32)


def step_of(number: int, row_ids: np.ndarray, finish: np.ndarray | None = None) -> Step:
    tokens = (row_ids + number * 1000).astype(np.int32)
    codes = np.zeros(len(row_ids), np.int8) if finish is None else finish
    return Step.one_token_each(number, len(row_ids), row_ids, tokens, codes)


@pytest.mark.unit
def test_a_step_of_one_token_a_row_decodes_to_the_arrays_it_was_encoded_from() -> None:
    step = step_of(41, arange(ROWS, 100))
    decoded = decode_step(encode_step(step))
    assert decoded.step == 41 and decoded.running == ROWS and decoded.sent_ns > 0
    np.testing.assert_array_equal(decoded.row_ids, step.row_ids)
    np.testing.assert_array_equal(decoded.tokens, step.tokens)
    np.testing.assert_array_equal(decoded.offsets, step.offsets)
    assert decoded.logprobs is None and decoded.notes == {}
    assert decoded.row_tokens(3).tolist() == [41103] and decoded.row_finish(3) is None


@pytest.mark.unit
def test_rows_may_carry_several_tokens_a_step_through_the_offsets() -> None:
    step = Step(
        5,
        9,
        arange(3),
        np.array([0, 2, 2, 5], np.int32),
        np.array([10, 11, 20, 21, 22], np.int32),
        np.zeros(3, np.int8),
    )
    decoded = decode_step(encode_step(step))
    assert [decoded.row_tokens(i).tolist() for i in range(3)] == [[10, 11], [], [20, 21, 22]]


@pytest.mark.unit
def test_the_logprob_block_carries_the_chosen_and_top_logprobs_of_the_rows_that_asked() -> None:
    rng = np.random.default_rng(0)
    positions = np.array([1, 4, 200], np.int32)
    block = LogprobBlock(
        positions,
        rng.standard_normal(3).astype(np.float64),
        np.array([[5, 6, -1], [7, 8, 9], [1, -1, -1]], np.int32),
        rng.standard_normal((3, 3)).astype(np.float64),
    )
    step = Step.one_token_each(2, ROWS, arange(ROWS), arange(ROWS), np.zeros(ROWS, np.int8), block)
    decoded = decode_step(encode_step(step)).logprobs
    assert decoded is not None
    for name in LogprobBlock.__slots__:
        ours, theirs = getattr(decoded, name), getattr(block, name)
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.unit
def test_a_logprob_block_without_top_logprobs_has_zero_columns() -> None:
    empty = np.zeros((2, 0), np.int32)
    block = LogprobBlock(arange(2), np.array([-0.5, -1.5], np.float64), empty, empty.astype(np.float64))
    decoded = decode_step(
        encode_step(Step.one_token_each(1, 4, arange(4), arange(4), np.zeros(4, np.int8), block))
    ).logprobs
    assert decoded is not None and decoded.top_ids.shape == (2, 0)
    assert decoded.logprobs.tolist() == [-0.5, -1.5]


@pytest.mark.unit
def test_an_empty_step_crosses_with_its_step_number_and_running_rows() -> None:
    empty = np.zeros(0, np.int32)
    decoded = decode_step(encode_step(Step.one_token_each(9, 12, empty, empty, np.zeros(0, np.int8))))
    assert (decoded.step, decoded.running, len(decoded.row_ids), len(decoded.tokens)) == (9, 12, 0, 0)


@pytest.mark.unit
def test_many_rows_cross_in_one_buffer() -> None:
    rows = 100_000
    decoded = decode_step(encode_step(step_of(3, arange(rows))))
    assert len(decoded.row_ids) == rows and int(decoded.tokens[-1]) == 3000 + rows - 1


@pytest.mark.unit
def test_every_finish_crosses_as_its_code_with_its_notes() -> None:
    finishes = [None, *Finish]
    codes = np.array([0 if f is None else FINISH_CODES[f] for f in finishes], np.int8)
    notes = {4: {"error": "the grammar failed", "error_code": "invalid_response_format"}}
    rows = arange(len(finishes))
    decoded = decode_step(
        encode_step(Step(1, len(rows), rows, arange(len(rows) + 1), rows, codes, None, notes))
    )
    assert [decoded.row_finish(i) for i in range(len(finishes))] == finishes
    assert decoded.notes == notes


@pytest.mark.unit
def test_a_truncated_step_is_refused() -> None:
    payload = encode_step(step_of(1, arange(8)))
    with pytest.raises(StepDecodeError):
        decode_step(payload[:-1])


@pytest.mark.unit
def test_commands_cross_with_the_whole_request() -> None:
    request = GenerationRequest(
        list(range(5000)), 64, temperature=0.7, seed=3, guidance=("regex", "a+"), logit_bias=((5, -1.0),)
    )
    submit = decode_command(encode_command(Submit.of(12, request)))
    assert isinstance(submit, Submit) and submit.row_id == 12
    assert submit.prompt.dtype == np.int32 and submit.prompt.tolist() == request.prompt_ids
    assert submit.request == GenerationRequest(
        [], 64, temperature=0.7, seed=3, guidance=("regex", "a+"), logit_bias=((5, -1.0),)
    )
    assert decode_command(encode_command(Cancel(-3))) == Cancel(-3)
    assert decode_command(encode_command(Stop())) == Stop()
    with pytest.raises(CommandDecodeError):
        decode_command(b"C12")


def stub_engine_core(sock: socket.socket) -> None:
    """Runs the submitted request's max_new_tokens steps of ROWS rows, then more until a row is
    cancelled; a cancelled row ends at the next step and leaves the batch; stops at Stop."""
    core = CoreEnd(sock)
    (submit,) = core.wait_commands(10)
    assert isinstance(submit, Submit)
    rows = arange(ROWS)
    seen: list[Command] = []
    number = 0
    while number < submit.request.max_new_tokens or not any(isinstance(c, Cancel) for c in seen):
        seen += core.commands() if number < submit.request.max_new_tokens else core.wait_commands(10)
        cancelled = [c.row_id for c in seen if isinstance(c, Cancel)]
        finish = np.where(np.isin(rows, cancelled), FINISH_CODES[Finish.cancelled], 0).astype(np.int8)
        core.send_step(encode_step(step_of(number, rows, finish)))
        rows = rows[finish == 0]
        number += 1
    for _ in range(100):
        if any(isinstance(c, Stop) for c in seen) or core.closed:
            break
        seen += core.wait_commands(0.1)
    core.close()


async def test_a_frontend_reads_every_step_of_an_engine_core_process_and_its_cancel_is_seen() -> None:
    steps = 300
    core_end, frontend_sock = channel_pair()
    process = multiprocessing.get_context("spawn").Process(target=stub_engine_core, args=(core_end,))
    process.start()
    core_end.close()
    received: list[Step] = []
    wakeups = 0
    cancel_seen = asyncio.Event()
    closed = asyncio.Event()

    def on_steps(batch: list[Step]) -> None:
        nonlocal wakeups
        if not received:
            frontend.send(Cancel(CANCELLED_ROW))
        wakeups += 1
        received.extend(batch)
        if any((s.finish == FINISH_CODES[Finish.cancelled]).any() for s in batch):
            cancel_seen.set()

    frontend = FrontendEnd(frontend_sock, asyncio.get_running_loop(), on_steps, closed.set)
    try:
        frontend.send(Submit.of(0, GenerationRequest([1, 2, 3], steps)))
        await asyncio.wait_for(cancel_seen.wait(), 20)
        frontend.send(Stop())
        await asyncio.wait_for(closed.wait(), 20)
    finally:
        frontend.close()
        process.join(10)
    assert process.exitcode == 0
    assert [s.step for s in received] == list(range(len(received))) and len(received) >= steps
    (cancel_step,) = [s.step for s in received if (s.finish != 0).any()]
    for step in received:
        expected = arange(ROWS) if step.step <= cancel_step else np.delete(arange(ROWS), CANCELLED_ROW)
        np.testing.assert_array_equal(step.row_ids, expected)
        np.testing.assert_array_equal(step.tokens, expected + step.step * 1000)
        if step.step == cancel_step:
            assert step.row_finish(CANCELLED_ROW) is Finish.cancelled
            assert (step.finish != 0).sum() == 1
    assert wakeups <= len(received)
