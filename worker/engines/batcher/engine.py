"""The batcher's scheduling loop: requests join and leave the running batch at every step.

One thread owns the session, the KV slots and every row; the event loop talks to it through a command
queue (submit, cancel, restart, stop) and gets each iteration's tokens in one wake-up (deliver_all).
An iteration:
1. admits waiting requests, first come first served, while a slot is free and the KV budget holds their
   prompt plus max_tokens;
2. prefills: runs whole prompt chunks of at most `prefill_chunk` tokens, together within that budget, in
   the order and as far as the keys' shares of the engine's time allow (work_shares.py: a key's chunk
   waits while another key holding rows would finish its next piece sooner, so one key's short requests
   cannot fill every iteration with their prompts), the rows with the fewest prompt tokens left first
   among equals. Chunks sit at fixed
   offsets of a prompt (0, chunk, 2 chunk, ...), whatever else runs, so a prompt's KV is the same in
   every run of it.
   A row whose prompt is in gets its first token from the last chunk's logits and joins the decode rows;
3. decodes: one run steps every decode row by one token.
A prefill and decode rows cannot share a run (the graph takes one sequence length per run), so a long
prompt costs the decode rows one chunk per iteration, never its whole prefill.

Which slot each row holds, and where its KV moves, is rows.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og

from common.error_codes import ErrorCode
from worker.engine import (
    EngineUpdate,
    Finish,
    GenerationRequest,
    GenerationStream,
    TokenLogprobs,
    deliver_all,
)
from worker.engines.batcher.adapter_library import AdapterChange, AdapterLibrary
from worker.engines.batcher.counters import BatcherCounters
from worker.engines.batcher.grammar_starts import GrammarError, GrammarStart, GrammarStarts
from worker.engines.batcher.graph import DecoderGraph, open_session
from worker.engines.batcher.lora import AdapterSet
from worker.engines.batcher.prefix_cache import PrefixCache
from worker.engines.batcher.rows import Row, Rows
from worker.engines.batcher.sampler import BiasOutsideVocabulary, RowSampler, token_logprobs
from worker.engines.engine_thread import EngineThread, Updates
from worker.engines.genai_config import context_length, vocab_size
from worker.engines.ort_tokenizer import OrtTokenizer
from worker.engines.work_shares import Chunk, WorkShares, prompt_chunk

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 8
DEFAULT_PREFILL_CHUNK = 128


class AdapterTaken(ValueError):
    """A load names an adapter the engine serves already."""


@dataclass(frozen=True)
class Picked:
    """A row's next token as the sampler graph picked it (device_sampling/), with its log-probabilities
    when the request asked for them."""

    token: int
    logprobs: TokenLogprobs | None


class BatchingEngine(EngineThread):
    """worker.engine.Engine on ortfleet's continuous batcher (see the module's docstring)."""

    continuous_batching = True
    kv_budget_source = "ORTFLEET_KV_BUDGET_TOKENS"  # where the KV budget a refusal names comes from
    handles_stop_strings = False  # the job runner matches stop strings on the text
    exposes_logits = True
    replays_guidance = True
    closes_documents = True
    adapters: AdapterSet | None = None  # the layouts of the adapters loaded
    _unloaded: frozenset[str] = frozenset()  # (the engine's thread's) refused from now on, named so

    def __init__(
        self,
        model_dir: Path,
        slots: int | None = None,
        kv_budget_tokens: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        step_delay_s: float = 0.0,
        prefix_cache: bool = True,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        """`adapters`: LoRA adapters (name: PEFT folder) that requests may name (lora.py); each is checked
        against the model, and the graph is rewritten for them only where there is one."""
        super().__init__("batcher")
        capacity = slots or DEFAULT_SLOTS
        self._take_model(model_dir, prefill_chunk, step_delay_s, AdapterLibrary(model_dir, adapters or {}))
        try:
            session, layout = open_session(model_dir, graph=self._library.rewritten())
        except ort.capi.onnxruntime_pybind11_state.Fail as e:  # a graph or weights it cannot load
            raise ValueError(str(e)) from e
        self._graph = DecoderGraph(session, layout, self.adapters)
        self.vocab_size = layout.vocab_size
        self.prefix_block_tokens = prefill_chunk if prefix_cache else 0
        self.work_shares = WorkShares()
        prefixes = PrefixCache(prefill_chunk) if prefix_cache else None
        budget = kv_budget_tokens or capacity * self.context_length
        self._rows = Rows(layout, capacity, self.context_length, budget, prefixes, self.counters)
        self._thread.start()

    def _take_model(
        self, model_dir: Path, prefill_chunk: int, step_delay_s: float, library: AdapterLibrary
    ) -> None:
        """What this engine and the paged engine keep of the model and its requests alike: the tokenizer
        and end of sequence, the adapters, the grammars' starts, the counters."""
        self.context_length = context_length(model_dir)
        self.prefill_chunk = prefill_chunk
        self._step_delay_s = step_delay_s
        self._model_dir = model_dir
        self.tokenizer = OrtTokenizer(og.Config(str(model_dir)), vocab_size(model_dir), model_dir)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._library = library
        self.adapters: AdapterSet | None = library.layouts()
        self._adapter_lock = asyncio.Lock()  # one load or unload at a time works out its change
        self._between: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # run after a step
        self._draining: dict[str, concurrent.futures.Future[None]] = {}  # unloaded, rows still running
        self._retirements: set[asyncio.Task[None]] = set()
        self.counters = BatcherCounters()
        self._grammars = GrammarStarts(model_dir, self.eos_token_ids, self.counters)
        self._starts: dict[int, GrammarStart] = {}  # by id of the stream whose request's grammar it starts

    # The event loop's side.

    @property
    def capacity(self) -> int:
        """Rows the batch holds at once (the worker lowers it after warm-up where the engine fell short)."""
        return self._rows.capacity

    @capacity.setter
    def capacity(self, rows: int) -> None:
        self._rows.capacity = rows

    @property
    def kv_budget_tokens(self) -> int:
        return self._rows.kv.budget_tokens

    @property
    def kv_tokens_reserved(self) -> int:
        return self._rows.kv.reserved

    @property
    def prefix_cache_tokens(self) -> int:
        """Tokens of prompt KV kept in free slots for reuse."""
        prefixes = self._rows.prefixes
        return 0 if prefixes is None else prefixes.tokens

    def rows(self) -> tuple[int, int, int]:
        """Requests waiting for a slot or KV, prefilling, decoding."""
        rows = self._rows
        return len(rows.waiting), len(rows.prefilling), len(rows.decoding)

    def _hand(self, streams: list[GenerationStream]) -> None:
        """A structured request reaches the engine's thread once its grammar's start is known (computed off
        that thread, once per grammar: grammar_starts.py); the others at once."""
        plain = [stream for stream in streams if stream.request.guidance is None]
        if plain:
            self._commands.put(("submit", plain))
        for stream in streams:
            guidance = stream.request.guidance
            if guidance is not None:
                self._grammars.prepare(guidance, functools.partial(self._grammar_ready, stream))

    def _grammar_ready(self, stream: GenerationStream, start: GrammarStart) -> None:
        self._starts[id(stream)] = start
        self._commands.put(("submit", [stream]))

    def close(self) -> None:
        super().close()
        self._grammars.close()

    # Adapters loaded and unloaded at run time (adapter_library.py works out each change).

    async def load_adapter(self, name: str, folder: Path) -> None:
        """Serves the PEFT adapter in `folder` to requests naming `name` from the next step on. It is read
        and checked off the engine's thread (AdapterMismatch, AdapterUnreadable, as at start; AdapterTaken
        when the name is served, or its unloaded rows still run); the new layouts, and a new session where
        it targets projections the graph was not rewritten for, are swapped in between two steps. Running
        rows keep their adapters' columns."""
        async with self._adapter_lock:
            if name in self._library.adapters:
                still = " (unloaded, its requests still running)" if name in self._draining else ""
                raise AdapterTaken(f"the adapter {name!r} is already loaded{still}")
            change = await asyncio.to_thread(self._library.with_adapter, name, folder)
            await self._between_steps(functools.partial(self._swap, change, name))
            self._library.commit(change)

    async def unload_adapter(self, name: str) -> None:
        """Refuses new requests naming the adapter from the next step on (KeyError when it is not served);
        its running and waiting rows run to their end, then it leaves the layouts and its prompts the
        prefix cache (in the background)."""
        async with self._adapter_lock:
            if name not in self._library.adapters or name in self._draining:
                raise KeyError(name)
            drained: concurrent.futures.Future[None] = concurrent.futures.Future()
            await self._between_steps(functools.partial(self._refuse_adapter, name, drained))
        task = asyncio.create_task(self._retire(name, drained), name=f"retire-{name}")
        self._retirements.add(task)
        task.add_done_callback(self._retirements.discard)

    async def _retire(self, name: str, drained: concurrent.futures.Future[None]) -> None:
        await asyncio.wrap_future(drained)
        async with self._adapter_lock:
            change = await asyncio.to_thread(self._library.without, name)
            await self._between_steps(functools.partial(self._swap, change, None))
            self._library.commit(change)

    async def _between_steps(self, change: Callable[[], None]) -> None:
        """Runs `change` on the engine's thread after its current step (waking it when idle)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                change()
            except BaseException as e:
                done.set_exception(e)
            else:
                done.set_result(None)

        self._between.put(run)
        self._commands.put(("submit", []))  # wakes an idle thread: no request, a step of nothing
        await asyncio.wrap_future(done)

    def _adapter_changes(self) -> None:
        """The engine's thread, after a step: the changes waiting, then the unloaded adapters whose rows
        have all ended."""
        while True:
            try:
                self._between.get_nowait()()
            except queue.Empty:
                break
        if self._draining:
            used = {row.request.adapter for row in self._rows.every()}
            for name in [name for name in self._draining if name not in used]:
                self._forget_prompts(name)
                self._draining.pop(name).set_result(None)

    def _forget_prompts(self, adapter: str) -> None:
        """The prefix cache drops the prompts of an adapter that leaves (another of its name may come)."""
        prefixes = self._rows.prefixes
        if prefixes is not None:
            prefixes.drop_scopes(f"\0lora:{adapter}")

    def _swap(self, change: AdapterChange, loaded: str | None) -> None:
        if change.session is not None:
            session, layout = change.session
            self._graph = DecoderGraph(session, layout, change.layouts)
        else:
            self._graph.adapters = change.layouts  # each binding binds the new layouts at its next run
        self.adapters = change.layouts
        self._unloaded -= {loaded}

    def _refuse_adapter(self, name: str, drained: concurrent.futures.Future[None]) -> None:
        self._unloaded |= {name}
        self._draining[name] = drained

    # The batcher's thread.

    def _main(self) -> None:
        try:
            while True:
                busy = bool(self._rows.waiting or self._rows.running())
                if not self._drain_commands(block=not busy):
                    return
                if self._failed:
                    continue
                updates: Updates = []
                self._step(updates)
                self._adapter_changes()
                deliver_all(updates)
                if self._step_delay_s and self._rows.running():
                    time.sleep(self._step_delay_s)
        except BaseException:
            logger.exception("the %s thread died", self._thread.name)
            raise

    def _step(self, updates: Updates) -> None:
        """One iteration: admissions, prompt chunks, then one decode run (see the module's docstring).
        The adapters' changes follow each step (`_main`)."""
        self._rows.admit()
        self._prefill(updates)
        self._decode(updates)

    def _start(self, stream: GenerationStream, updates: Updates) -> None:
        request = stream.request
        if stream.cancel_requested:  # while its grammar's start was computed
            self._starts.pop(id(stream), None)
            updates.append((stream, EngineUpdate([], Finish.cancelled, batch_rows=self._rows.running())))
            return
        before = len(request.prompt_ids) + len(request.replay_ids)
        reserved = min(self.context_length, before + request.max_new_tokens)
        code = ErrorCode.context_length_exceeded
        if request.adapter is not None and request.adapter not in self._adapter_names:
            error, code = self._unknown_adapter(request.adapter), ErrorCode.model_not_found
        elif not request.prompt_ids or before >= self.context_length:
            error = f"the prompt holds {before} tokens; the model's context is {self.context_length}"
        elif reserved > self.kv_budget_tokens:
            error = (
                f"the request needs {reserved} tokens of KV cache (prompt and max_tokens); this worker's "
                f"budget is {self.kv_budget_tokens} ({self.kv_budget_source})"
            )
        else:
            grammar = self._starts.pop(id(stream), None)
            try:
                sampler = RowSampler(request, self.eos_token_ids, self.vocab_size, grammar)
            except GrammarError as e:
                error, code = str(e), ErrorCode.invalid_response_format
            except BiasOutsideVocabulary as e:
                error, code = str(e), ErrorCode.unsupported_value
            else:
                too_small = None if grammar is None else self._too_small(request, grammar)
                if too_small is None:
                    self._queue(Row(stream, sampler, reserved))
                    return
                error, code = too_small, ErrorCode.max_tokens_too_small
        updates.append((stream, EngineUpdate([], Finish.error, error, error_code=code)))

    @property
    def _adapter_names(self) -> list[str]:
        """The adapters new requests may name (not those unloaded, whose rows still run)."""
        loaded = [] if self.adapters is None else self.adapters.names
        return [name for name in loaded if name not in self._unloaded]

    def _unknown_adapter(self, name: str) -> str:
        served = ", ".join(self._adapter_names) or "none"
        if name in self._unloaded:
            return f"the adapter {name!r} was unloaded from this worker (its adapters: {served})"
        return f"the adapter {name!r} is not loaded on this worker (its adapters: {served})"

    def _queue(self, row: Row) -> None:
        """A request that passed its checks waits for a slot."""
        self._rows.waiting.append(row)

    def _budget(self, request: GenerationRequest) -> int:
        """The tokens a request may generate, replayed ones included (max_tokens, and the context)."""
        replayed = len(request.replay_ids)
        return min(request.max_new_tokens + replayed, self.context_length - len(request.prompt_ids))

    def _too_small(self, request: GenerationRequest, grammar: GrammarStart) -> str | None:
        """Why a structured request cannot end its document within its max_tokens, where it is proven that
        no document of its format fits (grammar_starts.py): a request that may fit is never refused."""
        if request.replay_ids or not request.close_early or grammar.ending is None:  # replayed: it fitted
            return None
        needed = len(grammar.ending.tokens)
        budget = self._budget(request)
        if needed <= budget or budget >= grammar.at_least:
            return None
        room = (
            f"max_tokens: the answer has room for {budget} tokens (max_tokens, within the model's context "
            "after the prompt), and "
        )
        advice = "(or set close_early to false to get the cut text)"
        if grammar.proven_shortest:
            return (
                f"{room}the shortest document of its response format found takes {needed} tokens on this "
                f"model; ask for at least {needed} {advice}"
            )
        return (
            f"{room}no document of its response format fits in fewer than {grammar.at_least} tokens on this "
            f"model; the shortest found takes {needed} tokens: ask for {needed} {advice}"
        )

    def _cancel(self, stream: GenerationStream, updates: Updates) -> None:
        for row in self._rows.every():
            if row.stream is stream:
                self._rows.end(row)
                updates.append((stream, EngineUpdate([], Finish.cancelled, batch_rows=self._rows.running())))
                return

    def _prefill(self, updates: Updates) -> None:
        """Prompt chunks, up to `prefill_chunk` tokens this iteration, in the order and as far as the keys'
        shares of the engine allow (work_shares.py)."""
        shares, rows = self.work_shares, self._rows
        shares.hold(row.request.owner for row in (*rows.prefilling, *rows.decoding))
        decoding = {row.request.owner: row.request.weight for row in rows.decoding}
        pending = [self._chunk(row) for row in rows.prefilling]
        for chunk in shares.chunks(pending, decoding, self.prefill_chunk):
            row = chunk.row
            start = row.length
            stop = start + chunk.tokens
            ids = np.asarray([row.request.prompt_ids[start:stop]], np.int64)
            mask = np.ones((1, stop), np.int64)
            began = time.perf_counter()
            try:
                kv = self._rows.kv.values(row.slot, row.slot + 1)
                logits = self._graph.run(ids, mask, (row.slot, row.slot + 1), kv, [row.request.adapter])
            except Exception as e:  # this prompt broke the run: its request fails, the others go on
                logger.exception("a prefill run failed")
                self._rows.end(row)
                updates.append((row.stream, EngineUpdate([], Finish.error, f"prefill failed: {e}")))
                continue
            self._add_prompt_logprobs(row, start, logits[0])
            self.counters.prefill_tokens += stop - start
            self.counters.prefill_runs += 1
            row.length = stop
            if row.prompt_left == 0:
                self._rows.join_decoding(row)
                self._next(row, logits[0, -1], updates)
            took = time.perf_counter() - began
            shares.ran_prefill(chunk.tokens, took)
            shares.charge(row.request.owner, row.request.weight, took)

    def _chunk(self, row: Row) -> Chunk[Row]:
        request = row.request
        prompt = len(request.prompt_ids)
        return prompt_chunk(row, request.owner, request.weight, row.length, prompt, self.prefill_chunk)

    def _add_prompt_logprobs(self, row: Row, start: int, logits: np.ndarray) -> None:
        """When the request asks for them, the log-probabilities of the prompt tokens that `logits` predict:
        the logits [tokens, vocab] of the row's prompt positions from `start` on, each one's giving the
        next token's (the first prompt token has none). The engine hands them on with the first token."""
        if (top := row.request.prompt_logprobs) is None:
            return
        prompt = row.request.prompt_ids
        for position in range(start, min(start + len(logits), len(prompt) - 1)):
            row.prompt_logprobs.append(token_logprobs(logits[position - start], prompt[position + 1], top))

    def _decode(self, updates: Updates) -> None:
        decoding = self._rows.decoding
        if not decoding:
            return
        count = len(decoding)
        ids = np.asarray([[row.next_token] for row in decoding], np.int64)
        width = max(row.length for row in decoding) + 1
        mask = np.zeros((count, width), np.int64)
        for index, row in enumerate(decoding):
            mask[index, : row.length + 1] = 1
        began = time.perf_counter()
        try:
            adapters = () if self.adapters is None else [row.request.adapter for row in decoding]
            logits = self._graph.run(ids, mask, (0, count), self._rows.kv.values(0, count), adapters)
        except Exception as e:
            self._fail(f"a decode run failed: {e}")
            return
        self.counters.decode_steps += 1
        self.counters.decode_tokens += count
        stepped = list(decoding)
        for row in stepped:  # every row's new KV is in before a row that ends moves another
            row.length += 1
        shares = self.work_shares
        now = time.perf_counter()
        each = (now - began) / count  # the run's time, split evenly; each row's own pick on top
        for index, row in enumerate(stepped):
            self._next(row, logits[index, -1], updates)
            picked, now = now, time.perf_counter()
            shares.charge(row.request.owner, row.request.weight, each + now - picked)
        shares.ran_decode(count, now - began)

    def _next(self, row: Row, logits: np.ndarray, updates: Updates, picked: Picked | None = None) -> None:
        """The row's next token from its logits, or as the sampler graph `picked` it: replayed, delivered,
        or the row's end."""
        request = row.request
        wants_logprobs = request.logprobs is not None and not row.replaying
        raw = logits.copy() if wants_logprobs and picked is None else None
        try:
            if picked is None:
                left = self._budget(request) - row.replayed - row.produced
                token = row.sampler.choose(logits, row.produced, left)
            else:
                token = picked.token
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
            self._rows.end(row)
            code = ErrorCode.invalid_response_format
            update = EngineUpdate([], Finish.error, str(e), self._rows.running(), code)
            updates.append((row.stream, update))
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
        closed = finish is not None and row.sampler.closed_early
        if closed and finish is Finish.length:  # the closer ended the document on the last token
            closed = row.sampler.grammar_complete
            finish = Finish.eos if closed else finish
        cut_unclosed = finish is Finish.length and row.sampler.closing_off  # asked to close, and could not
        rows = self._rows.running()
        if finish is not None:
            self._rows.end(row)
        else:
            row.next_token = token
        logprobs = None
        if wants_logprobs and tokens:
            if picked is not None and picked.logprobs is not None:
                logprobs = (picked.logprobs,)
            elif raw is not None:
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
            closed_early=True if closed else (False if cut_unclosed else None),
        )
        updates.append((row.stream, update))

    def _fail(self, cause: str) -> None:
        """A decode run failed: no row's KV can be trusted. Every request goes back to the queue (`lost`),
        and the worker restarts the engine (on_failure)."""
        logger.error("the %s engine failed: %s", self._thread.name, cause)
        rows = self._rows.clear()
        self._failed = cause
        deliver_all([(row.stream, EngineUpdate([], Finish.lost, cause)) for row in rows])
        self._tell_failure(cause)

    def _renew(self) -> None:
        self._graph.forget()
        self._rows.reset()
        logger.info("the batcher starts again with fresh KV slots")
