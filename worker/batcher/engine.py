"""The batcher's scheduling loop: requests join and leave the running batch at every step.

One thread owns the session, the KV slots and every row; the event loop talks to it through a command
queue (submit, cancel, restart, stop) and gets each iteration's tokens in one wake-up (deliver_all).
An iteration:
1. admits waiting requests, first come first served, while a slot is free and the KV budget holds their
   prompt plus max_tokens;
2. prefills: runs prompt chunks of at most `prefill_chunk` tokens, the rows with the fewest prompt
   tokens left first, until the iteration's chunk budget is spent. Chunks sit at fixed offsets of a
   prompt (0, chunk, 2 chunk, ...), whatever else runs, so a prompt's KV is the same in every run of it.
   A row whose prompt is in gets its first token from the last chunk's logits and joins the decode rows;
3. decodes: one run steps every decode row by one token.
A prefill and decode rows cannot share a run (the graph takes one sequence length per run), so a long
prompt costs the decode rows one chunk per iteration, never its whole prefill.

Decode rows hold the slots [0, rows) (a run binds them as one tensor); a prefilling row holds a slot
above them and moves down when its prompt is in; a row that ends is replaced by the last one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
from llguidance import LLTokenizer

from common.error_codes import ErrorCode
from worker.batcher.graph import DecoderGraph, open_session
from worker.batcher.kv_slots import KvSlots
from worker.batcher.prefix_cache import PrefixCache
from worker.batcher.sampler import BiasOutsideVocabulary, GrammarError, RowSampler, token_logprobs
from worker.engine import (
    EngineUpdate,
    Finish,
    GenerationRequest,
    GenerationStream,
    TokenLogprobs,
    deliver_all,
)
from worker.engine_thread import EngineThread
from worker.ort_engine import OrtTokenizer, context_length, vocab_size

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 8
DEFAULT_PREFILL_CHUNK = 128


@dataclass(eq=False)
class _Row:
    stream: GenerationStream
    sampler: RowSampler
    reserved: int  # KV tokens held in the budget
    slot: int = -1
    length: int = 0  # tokens in the row's KV
    next_token: int = -1  # fed at the row's next decode step
    produced: int = 0  # tokens generated after the replayed ones
    replayed: int = 0
    exact: bool = True
    decoding: bool = False
    first_update: bool = True
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when the request asks for them

    @property
    def request(self) -> GenerationRequest:
        return self.stream.request

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt_ids) - self.length

    @property
    def replaying(self) -> bool:
        return self.replayed < len(self.request.replay_ids)


@dataclass
class BatcherCounters:
    """What the batcher has run since it started (read from any thread)."""

    prefill_tokens: int = 0  # prompt tokens through the graph
    prefill_runs: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0  # rows over all decode steps
    prefix_tokens_queried: int = 0  # prompt tokens of the requests admitted with the prefix cache on
    prefix_hits: int = 0  # requests that started from a cached prompt prefix
    prefix_tokens_reused: int = 0  # prompt tokens those requests did not prefill


@dataclass
class _Iteration:
    updates: list[tuple[GenerationStream, EngineUpdate]] = field(default_factory=list)


class BatchingEngine(EngineThread):
    """worker.engine.Engine on ortfleet's continuous batcher (see the module's docstring)."""

    continuous_batching = True
    handles_stop_strings = False  # the job runner matches stop strings on the text
    exposes_logits = True
    replays_guidance = True

    def __init__(
        self,
        model_dir: Path,
        slots: int | None = None,
        kv_budget_tokens: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        step_delay_s: float = 0.0,
        prefix_cache: bool = True,
    ) -> None:
        self.context_length = context_length(model_dir)
        self.capacity = slots or DEFAULT_SLOTS
        self.prefill_chunk = prefill_chunk
        self.kv_budget_tokens = kv_budget_tokens or self.capacity * self.context_length
        self._step_delay_s = step_delay_s
        self._model_dir = model_dir
        self.on_failure: Callable[[str], None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[tuple[str, list[GenerationStream]]] = queue.SimpleQueue()
        self._restarted: concurrent.futures.Future[None] | None = None
        self._failed: str | None = None
        config = og.Config(str(model_dir))
        self.tokenizer = OrtTokenizer(config, vocab_size(model_dir), model_dir)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        try:
            session, layout = open_session(model_dir)
        except ort.capi.onnxruntime_pybind11_state.Fail as e:  # a graph or weights it cannot load
            raise ValueError(str(e)) from e
        self._graph = DecoderGraph(session, layout)
        self.vocab_size = layout.vocab_size
        self._kv = self._new_kv()
        self._prefixes = PrefixCache(prefill_chunk) if prefix_cache else None
        self.prefix_block_tokens = prefill_chunk if prefix_cache else 0
        self._grammar_tokenizer: LLTokenizer | None = None
        self._waiting: deque[_Row] = deque()
        self._prefilling: list[_Row] = []
        self._decoding: list[_Row] = []  # row i holds slot i
        self.counters = BatcherCounters()
        self._thread = threading.Thread(target=self._main, name="batcher", daemon=True)
        self._thread.start()

    # The event loop's side.

    @property
    def kv_tokens_reserved(self) -> int:
        return self._kv.reserved

    @property
    def prefix_cache_tokens(self) -> int:
        """Tokens of prompt KV kept in free slots for reuse."""
        return 0 if self._prefixes is None else self._prefixes.tokens

    def rows(self) -> tuple[int, int, int]:
        """Requests waiting for a slot or KV, prefilling, decoding."""
        return len(self._waiting), len(self._prefilling), len(self._decoding)

    # The batcher's thread.

    def _new_kv(self) -> KvSlots:
        return KvSlots(self._graph.layout, self.capacity, self.context_length, self.kv_budget_tokens)

    def _main(self) -> None:
        try:
            while True:
                busy = bool(self._waiting or self._prefilling or self._decoding)
                if not self._drain_commands(block=not busy):
                    return
                if self._failed:
                    continue
                iteration = _Iteration()
                self._admit(iteration)
                self._prefill(iteration)
                self._decode(iteration)
                deliver_all(iteration.updates)
                if self._step_delay_s and (self._prefilling or self._decoding):
                    time.sleep(self._step_delay_s)
        except BaseException:
            logger.exception("the batcher's thread died")
            raise

    def _drain_commands(self, *, block: bool) -> bool:
        try:
            command, streams = self._commands.get(block=block)
        except queue.Empty:
            return True
        updates: list[tuple[GenerationStream, EngineUpdate]] = []
        while True:
            if command == "stop":
                return False
            if command == "restart":
                self._restart()
            for stream in streams:
                if command == "submit" and self._failed:
                    updates.append((stream, EngineUpdate([], Finish.lost, self._failed)))
                elif command == "submit":
                    self._accept(stream, updates)
                else:
                    self._cancel(stream, updates)
            try:
                command, streams = self._commands.get_nowait()
            except queue.Empty:
                deliver_all(updates)
                return True

    def _accept(self, stream: GenerationStream, updates: list[tuple[GenerationStream, EngineUpdate]]) -> None:
        request = stream.request
        before = len(request.prompt_ids) + len(request.replay_ids)
        if not request.prompt_ids or before >= self.context_length:
            error = f"the prompt holds {before} tokens; the model's context is {self.context_length}"
            updates.append(
                (stream, EngineUpdate([], Finish.error, error, error_code=ErrorCode.context_length_exceeded))
            )
            return
        reserved = min(self.context_length, before + request.max_new_tokens)
        if reserved > self._kv.budget_tokens:
            error = (
                f"the request needs {reserved} tokens of KV cache (prompt and max_tokens); this worker's "
                f"budget is {self._kv.budget_tokens} (ORTFLEET_KV_BUDGET_TOKENS)"
            )
            updates.append(
                (stream, EngineUpdate([], Finish.error, error, error_code=ErrorCode.context_length_exceeded))
            )
            return
        try:
            sampler = RowSampler(request, self.eos_token_ids, self.vocab_size, self._grammar(request))
        except GrammarError as e:
            updates.append(
                (stream, EngineUpdate([], Finish.error, str(e), error_code=ErrorCode.invalid_response_format))
            )
            return
        except BiasOutsideVocabulary as e:
            updates.append(
                (stream, EngineUpdate([], Finish.error, str(e), error_code=ErrorCode.unsupported_value))
            )
            return
        self._waiting.append(_Row(stream, sampler, reserved))

    def _grammar(self, request: GenerationRequest) -> LLTokenizer | None:
        if request.guidance is None:
            return None
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = LLTokenizer(
                str(self._model_dir / "tokenizer.json"), eos_token=sorted(self.eos_token_ids)
            )
        return self._grammar_tokenizer

    def _cancel(self, stream: GenerationStream, updates: list[tuple[GenerationStream, EngineUpdate]]) -> None:
        for row in [*self._waiting, *self._prefilling, *self._decoding]:
            if row.stream is stream:
                self._end(row)
                updates.append((stream, EngineUpdate([], Finish.cancelled, batch_rows=self._rows())))
                return

    def _rows(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def _admit(self, iteration: _Iteration) -> None:
        while self._waiting and self._rows() < self.capacity and self._kv.fits(self._waiting[0].reserved):
            row = self._waiting.popleft()
            held = {r.slot for r in self._prefilling} | set(range(len(self._decoding)))
            free = set(range(self.capacity)) - held
            self._take_slot(row, free)
            self._kv.reserve(row.reserved)
            self._prefilling.append(row)

    def _take_slot(self, row: _Row, free: set[int]) -> None:
        """The slot holding the longest cached prefix of the row's prompt, from which it prefills the
        rest; else a free slot, from the top (prefix_cache.py)."""
        if self._prefixes is None:
            row.slot = max(free)
            return
        if row.request.prompt_logprobs is not None:  # every prompt position's logits are needed
            slot, reused = None, 0
        else:
            slot, reused = self._prefixes.match(row.request.prompt_ids, free)
        self.counters.prefix_tokens_queried += len(row.request.prompt_ids)
        if slot is None:
            slot = self._prefixes.victim(free)
        else:
            row.length = row.cached = reused
            self.counters.prefix_hits += 1
            self.counters.prefix_tokens_reused += reused
        self._prefixes.forget(slot)
        row.slot = slot

    def _end(self, row: _Row) -> None:
        """Takes the row out of the batch and gives back its slot and KV."""
        if row in self._waiting:
            self._waiting.remove(row)
            return
        self._kv.release(row.reserved)
        if row in self._prefilling:
            self._prefilling.remove(row)
            return
        last = self._decoding[-1]
        kept = 0 if self._prefixes is None else self._prefixes.usable(row.request.prompt_ids)
        if last is not row:  # the last decode row fills the gap; the ended row's prompt KV takes its slot
            if kept:
                self._kv.swap(last.slot, last.length, row.slot, kept)
            else:
                self._kv.move(last.slot, row.slot, last.length)
            row.slot, last.slot = last.slot, row.slot
            self._decoding[last.slot] = last
        self._decoding.pop()
        if self._prefixes is not None:
            self._prefixes.keep(row.slot, row.request.prompt_ids)

    def _prefill(self, iteration: _Iteration) -> None:
        spent = 0
        for row in sorted(self._prefilling, key=lambda r: r.prompt_left):
            if spent >= self.prefill_chunk:
                break
            start = row.length
            stop = min(len(row.request.prompt_ids), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            ids = np.asarray([row.request.prompt_ids[start:stop]], np.int64)
            mask = np.ones((1, stop), np.int64)
            try:
                logits = self._graph.run(
                    ids, mask, (row.slot, row.slot + 1), self._kv.values(row.slot, row.slot + 1)
                )
            except Exception as e:  # this prompt broke the run: its request fails, the others go on
                logger.exception("a prefill run failed")
                self._end(row)
                iteration.updates.append((row.stream, EngineUpdate([], Finish.error, f"prefill failed: {e}")))
                continue
            if (top := row.request.prompt_logprobs) is not None:
                prompt = row.request.prompt_ids
                for position in range(start, min(stop, len(prompt) - 1)):  # each predicts the next token
                    found = token_logprobs(logits[0, position - start], prompt[position + 1], top)
                    row.prompt_logprobs.append(found)
            spent += stop - start
            self.counters.prefill_tokens += stop - start
            self.counters.prefill_runs += 1
            row.length = stop
            if row.prompt_left == 0:
                self._join_decoding(row)
                self._next(row, logits[0, -1], iteration)

    def _join_decoding(self, row: _Row) -> None:
        self._prefilling.remove(row)
        target = len(self._decoding)
        if row.slot != target:
            other = next((r for r in self._prefilling if r.slot == target), None)
            cached = 0 if self._prefixes is None else self._prefixes.length(target)
            if other is not None:  # a prefilling row sits where the decode rows end: they trade slots
                self._kv.swap(row.slot, row.length, target, other.length)
                other.slot = row.slot
            elif cached:  # a cached prefix sits there: it moves to the row's slot
                self._kv.swap(row.slot, row.length, target, cached)
                assert self._prefixes is not None
                self._prefixes.moved(target, row.slot)
            else:
                self._kv.move(row.slot, target, row.length)
            row.slot = target
        row.decoding = True
        self._decoding.append(row)

    def _decode(self, iteration: _Iteration) -> None:
        if not self._decoding:
            return
        count = len(self._decoding)
        ids = np.asarray([[row.next_token] for row in self._decoding], np.int64)
        width = max(row.length for row in self._decoding) + 1
        mask = np.zeros((count, width), np.int64)
        for index, row in enumerate(self._decoding):
            mask[index, : row.length + 1] = 1
        try:
            logits = self._graph.run(ids, mask, (0, count), self._kv.values(0, count))
        except Exception as e:
            self._fail(f"a decode run failed: {e}")
            return
        self.counters.decode_steps += 1
        self.counters.decode_tokens += count
        stepped = list(self._decoding)
        for row in stepped:  # every row's new KV is in before a row that ends moves another
            row.length += 1
        for index, row in enumerate(stepped):
            self._next(row, logits[index, -1], iteration)

    def _next(self, row: _Row, logits: np.ndarray, iteration: _Iteration) -> None:
        """The row's next token from its logits: replayed, delivered, or the row's end."""
        request = row.request
        raw = logits.copy() if request.logprobs is not None and not row.replaying else None
        try:
            token = row.sampler.choose(logits, row.produced)
            if row.replaying:
                expected = request.replay_ids[row.replayed]
                if token != expected:  # computed otherwise than the first time: the stream goes on as it was
                    row.exact = False
                row.replayed += 1
                row.sampler.accept(expected)
                row.next_token = expected
                return
            row.sampler.accept(token)
        except GrammarError as e:
            self._end(row)
            update = EngineUpdate([], Finish.error, str(e), self._rows(), ErrorCode.invalid_response_format)
            iteration.updates.append((row.stream, update))
            return
        row.produced += 1
        first, row.first_update = row.first_update, False
        exact = (row.exact if request.replay_ids else None) if first else None
        finish: Finish | None = None
        tokens = [token]
        if token in self.eos_token_ids:
            finish, tokens = Finish.eos, []
        elif row.sampler.grammar_done:
            finish = Finish.eos
        elif row.produced >= request.max_new_tokens or row.length + 1 >= self.context_length:
            finish = Finish.length
        rows = self._rows()
        if finish is not None:
            self._end(row)
        else:
            row.next_token = token
        logprobs = None
        if raw is not None and tokens:
            logprobs = (token_logprobs(raw, token, request.logprobs or 0),)
        cached = row.cached if first else None
        asked = first and request.prompt_logprobs is not None
        prompt_logprobs = tuple(row.prompt_logprobs) if asked else None
        update = EngineUpdate(
            tokens,
            finish,
            None,
            rows,
            replay_exact=exact,
            logprobs=logprobs,
            cached_tokens=cached,
            prompt_logprobs=prompt_logprobs,
        )
        iteration.updates.append((row.stream, update))

    def _fail(self, cause: str) -> None:
        """A decode run failed: no row's KV can be trusted. Every request goes back to the queue (`lost`),
        and the worker restarts the engine (on_failure)."""
        logger.error("the batcher failed: %s", cause)
        rows = [*self._waiting, *self._prefilling, *self._decoding]
        self._waiting.clear()
        self._prefilling.clear()
        self._decoding.clear()
        self._failed = cause
        deliver_all([(row.stream, EngineUpdate([], Finish.lost, cause)) for row in rows])
        self._tell_failure(cause)

    def _restart(self) -> None:
        restarted = self._restarted
        assert restarted is not None
        if self._failed is not None:
            try:
                self._graph.forget()
                self._kv = self._new_kv()
                if self._prefixes is not None:
                    self._prefixes.clear()
            except Exception as e:
                restarted.set_exception(e)
                return
            self._failed = None
            logger.info("the batcher starts again with fresh KV slots")
        restarted.set_result(None)
