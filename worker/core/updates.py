"""Engine updates across the step crossing: the engine core packs the updates one wake-up of its loop
collected for a frontend into one `Step`, and the frontend unpacks a step into each row's update.

A row may appear more than once in a step (two engine steps delivered before the core's loop ran), in
order. What is rare (an error, a replay's verdict, cached tokens, prompt log-probabilities, a closing)
travels in the step's notes, by the entry's index, and an entry's batch rows there only where they
differ from the step's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from common.error_codes import ErrorCode
from worker.core.step_wire import FINISH_CODES, FINISHES, LogprobBlock, Step
from worker.engine import EngineUpdate, TokenLogprobs

# The notes' key of the engine's own figures (not an entry's): the batcher's counters, rows by phase and
# KV, for the frontend's metrics.
ENGINE_STATS = -1


def pack(number: int, updates: list[tuple[int, EngineUpdate]]) -> Step:
    """One step of `updates`, each (row id, update), in order."""
    running = max(update.batch_rows for _, update in updates)
    row_ids: list[int] = []
    offsets = [0]
    tokens: list[int] = []
    finish: list[int] = []
    notes: dict[int, dict[str, Any]] = {}
    logprob_positions: list[int] = []
    logprob_entries: list[TokenLogprobs] = []
    for row, update in updates:
        if update.logprobs is not None:
            logprob_positions.extend(range(len(tokens), len(tokens) + len(update.logprobs)))
            logprob_entries.extend(update.logprobs)
        row_ids.append(row)
        tokens.extend(update.token_ids)
        offsets.append(len(tokens))
        finish.append(0 if update.finish is None else FINISH_CODES[update.finish])
        note = _note_of(update, running)
        if note:
            notes[len(row_ids) - 1] = note
    return Step(
        number,
        running,
        np.asarray(row_ids, np.int32),
        np.asarray(offsets, np.int32),
        np.asarray(tokens, np.int32),
        np.asarray(finish, np.int8),
        _block(logprob_positions, logprob_entries),
        notes,
    )


def _note_of(update: EngineUpdate, running: int) -> dict[str, Any]:
    note: dict[str, Any] = {}
    if update.error is not None:
        note["error"] = update.error
    if update.error_code is not None:
        note["error_code"] = update.error_code.value
    if update.replay_exact is not None:
        note["replay_exact"] = update.replay_exact
    if update.cached_tokens is not None:
        note["cached_tokens"] = update.cached_tokens
    if update.closed_early is not None:
        note["closed_early"] = update.closed_early
    if update.prompt_logprobs is not None:
        note["prompt_logprobs"] = [[entry.logprob, entry.top] for entry in update.prompt_logprobs]
    if update.batch_rows != running:
        note["batch_rows"] = update.batch_rows
    return note


def _block(positions: list[int], entries: list[TokenLogprobs]) -> LogprobBlock | None:
    if not entries:
        return None
    width = max(len(entry.top) for entry in entries)
    top_ids = np.full((len(entries), width), -1, np.int32)
    top_logprobs = np.zeros((len(entries), width), np.float64)
    for i, entry in enumerate(entries):
        for j, (token, logprob) in enumerate(entry.top):
            top_ids[i, j] = token
            top_logprobs[i, j] = logprob
    return LogprobBlock(
        np.asarray(positions, np.int32),
        np.asarray([entry.logprob for entry in entries], np.float64),
        top_ids,
        top_logprobs,
    )


def plain_step(step: Step) -> bool:
    """Whether the step holds a token for each row and nothing rare (the engine's figures aside): each
    row's update is then its one token and its finish."""
    notes = step.notes
    return (
        (not notes or (len(notes) == 1 and ENGINE_STATS in notes))
        and step.logprobs is None
        and len(step.tokens) == len(step.row_ids)
        and bool((np.diff(step.offsets) == 1).all())  # not a row with none beside one with two
    )


def unpack(step: Step) -> Iterator[tuple[int, EngineUpdate]]:
    """Each row's update in `step`, in order (plain Python values: lists, floats, no numpy scalars)."""
    row_ids = step.row_ids.tolist()
    offsets = step.offsets.tolist()
    tokens = step.tokens.tolist()
    finish = step.finish.tolist()
    running = step.running
    notes = step.notes
    if plain_step(step):
        # the common step: a token for each row, nothing rare
        for row, token, code in zip(row_ids, tokens, finish, strict=True):
            yield row, EngineUpdate([token], FINISHES[code], None, running)
        return
    logprobs = _entries(step.logprobs)
    for i, row in enumerate(row_ids):
        start, end = offsets[i], offsets[i + 1]
        note = notes.get(i) if notes else None
        update_logprobs = None
        if logprobs and start < end and start in logprobs:
            update_logprobs = tuple(logprobs[position] for position in range(start, end))
        if note is None and update_logprobs is None:
            yield row, EngineUpdate(tokens[start:end], FINISHES[finish[i]], None, running)
            continue
        note = note or {}
        code = note.get("error_code")
        prompt = note.get("prompt_logprobs")
        yield (
            row,
            EngineUpdate(
                tokens[start:end],
                FINISHES[finish[i]],
                error=note.get("error"),
                batch_rows=note.get("batch_rows", running),
                error_code=None if code is None else ErrorCode(code),
                replay_exact=note.get("replay_exact"),
                logprobs=update_logprobs,
                cached_tokens=note.get("cached_tokens"),
                prompt_logprobs=None
                if prompt is None
                else tuple(TokenLogprobs(lp, tuple((int(t), v) for t, v in top)) for lp, top in prompt),
                closed_early=note.get("closed_early"),
            ),
        )


def _entries(block: LogprobBlock | None) -> dict[int, TokenLogprobs]:
    """Each logprob entry of the step by its token's position."""
    if block is None:
        return {}
    top_ids = block.top_ids.tolist()
    top_logprobs = block.top_logprobs.tolist()
    return {
        position: TokenLogprobs(
            logprob, tuple((token, value) for token, value in zip(ids, values, strict=True) if token >= 0)
        )
        for position, logprob, ids, values in zip(
            block.positions.tolist(), block.logprobs.tolist(), top_ids, top_logprobs, strict=True
        )
    }
