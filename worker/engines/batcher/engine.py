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

Which slot each row holds, and where its KV moves, is rows.py's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
from llguidance import LLTokenizer

from common.error_codes import ErrorCode
from worker.engine import (
    EngineUpdate,
    Finish,
    GenerationRequest,
    GenerationStream,
    TokenLogprobs,
    deliver_all,
)
from worker.engines.batcher.closing_walk import ByteTokens
from worker.engines.batcher.counters import BatcherCounters
from worker.engines.batcher.graph import DecoderGraph, open_session
from worker.engines.batcher.prefix_cache import PrefixCache
from worker.engines.batcher.rows import Row, Rows
from worker.engines.batcher.sampler import BiasOutsideVocabulary, GrammarError, RowSampler, token_logprobs
from worker.engines.engine_thread import EngineThread, Updates
from worker.engines.genai_config import context_length, vocab_size
from worker.engines.ort_tokenizer import OrtTokenizer

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 8
DEFAULT_PREFILL_CHUNK = 128


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

    def __init__(
        self,
        model_dir: Path,
        slots: int | None = None,
        kv_budget_tokens: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        step_delay_s: float = 0.0,
        prefix_cache: bool = True,
    ) -> None:
        super().__init__("batcher")
        self.context_length = context_length(model_dir)
        capacity = slots or DEFAULT_SLOTS
        self.prefill_chunk = prefill_chunk
        self._step_delay_s = step_delay_s
        self._model_dir = model_dir
        config = og.Config(str(model_dir))
        self.tokenizer = OrtTokenizer(config, vocab_size(model_dir), model_dir)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        try:
            session, layout = open_session(model_dir)
        except ort.capi.onnxruntime_pybind11_state.Fail as e:  # a graph or weights it cannot load
            raise ValueError(str(e)) from e
        self._graph = DecoderGraph(session, layout)
        self.vocab_size = layout.vocab_size
        self.prefix_block_tokens = prefill_chunk if prefix_cache else 0
        self._grammar_tokenizer: LLTokenizer | None = None
        self._byte_tokens: ByteTokens | None = None
        self.counters = BatcherCounters()
        prefixes = PrefixCache(prefill_chunk) if prefix_cache else None
        budget = kv_budget_tokens or capacity * self.context_length
        self._rows = Rows(layout, capacity, self.context_length, budget, prefixes, self.counters)
        self._thread.start()

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
                deliver_all(updates)
                if self._step_delay_s and self._rows.running():
                    time.sleep(self._step_delay_s)
        except BaseException:
            logger.exception("the %s thread died", self._thread.name)
            raise

    def _step(self, updates: Updates) -> None:
        """One iteration: admissions, prompt chunks, then one decode run (see the module's docstring)."""
        self._rows.admit()
        self._prefill(updates)
        self._decode(updates)

    def _start(self, stream: GenerationStream, updates: Updates) -> None:
        request = stream.request
        before = len(request.prompt_ids) + len(request.replay_ids)
        reserved = min(self.context_length, before + request.max_new_tokens)
        code = ErrorCode.context_length_exceeded
        if not request.prompt_ids or before >= self.context_length:
            error = f"the prompt holds {before} tokens; the model's context is {self.context_length}"
        elif reserved > self.kv_budget_tokens:
            error = (
                f"the request needs {reserved} tokens of KV cache (prompt and max_tokens); this worker's "
                f"budget is {self.kv_budget_tokens} ({self.kv_budget_source})"
            )
        else:
            try:
                grammar = self._grammar(request)
                sampler = RowSampler(request, self.eos_token_ids, self.vocab_size, grammar, self._byte_tokens)
            except GrammarError as e:
                error, code = str(e), ErrorCode.invalid_response_format
            except BiasOutsideVocabulary as e:
                error, code = str(e), ErrorCode.unsupported_value
            else:
                too_small = self._too_small(request, sampler)
                if too_small is None:
                    self._queue(Row(stream, sampler, reserved))
                    return
                error, code = too_small, ErrorCode.max_tokens_too_small
        updates.append((stream, EngineUpdate([], Finish.error, error, error_code=code)))

    def _queue(self, row: Row) -> None:
        """A request that passed its checks waits for a slot."""
        self._rows.waiting.append(row)

    def _grammar(self, request: GenerationRequest) -> LLTokenizer | None:
        if request.guidance is None:
            return None
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = LLTokenizer(
                str(self._model_dir / "tokenizer.json"), eos_token=sorted(self.eos_token_ids)
            )
            self._byte_tokens = ByteTokens(self._grammar_tokenizer)
        return self._grammar_tokenizer

    def _budget(self, request: GenerationRequest) -> int:
        """The tokens a request may generate, replayed ones included (max_tokens, and the context)."""
        replayed = len(request.replay_ids)
        return min(request.max_new_tokens + replayed, self.context_length - len(request.prompt_ids))

    def _too_small(self, request: GenerationRequest, sampler: RowSampler) -> str | None:
        """Why a structured request cannot end its document within its max_tokens, if it cannot."""
        if request.replay_ids:  # its first attempt fitted
            return None
        needed = sampler.closing_length()
        budget = self._budget(request)
        if needed is None or needed <= budget:
            return None
        return (
            f"max_tokens: the answer has room for {budget} tokens (max_tokens, within the model's context "
            f"after the prompt), and the shortest document of its response format found takes {needed} "
            f"tokens on this model; ask for at least {needed} (or set close_early to false to get the cut "
            "text)"
        )

    def _cancel(self, stream: GenerationStream, updates: Updates) -> None:
        for row in self._rows.every():
            if row.stream is stream:
                self._rows.end(row)
                updates.append((stream, EngineUpdate([], Finish.cancelled, batch_rows=self._rows.running())))
                return

    def _prefill(self, updates: Updates) -> None:
        spent = 0
        for row in sorted(self._rows.prefilling, key=lambda r: r.prompt_left):
            if spent >= self.prefill_chunk:
                break
            start = row.length
            stop = min(len(row.request.prompt_ids), (start // self.prefill_chunk + 1) * self.prefill_chunk)
            ids = np.asarray([row.request.prompt_ids[start:stop]], np.int64)
            mask = np.ones((1, stop), np.int64)
            try:
                logits = self._graph.run(
                    ids, mask, (row.slot, row.slot + 1), self._rows.kv.values(row.slot, row.slot + 1)
                )
            except Exception as e:  # this prompt broke the run: its request fails, the others go on
                logger.exception("a prefill run failed")
                self._rows.end(row)
                updates.append((row.stream, EngineUpdate([], Finish.error, f"prefill failed: {e}")))
                continue
            self._add_prompt_logprobs(row, start, logits[0])
            spent += stop - start
            self.counters.prefill_tokens += stop - start
            self.counters.prefill_runs += 1
            row.length = stop
            if row.prompt_left == 0:
                self._rows.join_decoding(row)
                self._next(row, logits[0, -1], updates)

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
        try:
            logits = self._graph.run(ids, mask, (0, count), self._rows.kv.values(0, count))
        except Exception as e:
            self._fail(f"a decode run failed: {e}")
            return
        self.counters.decode_steps += 1
        self.counters.decode_tokens += count
        stepped = list(decoding)
        for row in stepped:  # every row's new KV is in before a row that ends moves another
            row.length += 1
        for index, row in enumerate(stepped):
            self._next(row, logits[index, -1], updates)

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
