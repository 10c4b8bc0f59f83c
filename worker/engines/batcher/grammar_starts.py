"""What a structured request's grammar costs before its first token, paid once per engine and never on the
engine's thread.

A grammar's start is its compiled matcher, the ending that closes its document from the start (the walk
of closing.py, up to `START_BUDGET` of matcher work) and the fewest tokens a document of it takes, as far
as fewest_tokens.py's search could prove them. None of it depends on the request besides its grammar: the
engine's tokenizer and end tokens are fixed. `GrammarStarts` computes it on a thread of its own when a
request is submitted, before the request reaches the engine's thread, and keeps the latest
`CACHED_GRAMMARS` of them: a key that sends one costly grammar again and again has it computed once, and
requests that wait for the same grammar wait for one computation. Each row then starts from a copy of the
matcher and the ending, which cost microseconds.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

from worker.engines.batcher.closing import Ending, first_ending
from worker.engines.batcher.closing_walk import WALK_LIMIT, ByteTokens, WalkBudget
from worker.engines.batcher.counters import BatcherCounters
from worker.engines.batcher.fewest_tokens import fewest_tokens
from worker.engines.batcher.json_keys import JsonKeys
from worker.engines.engine_errors import grammar_refused

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # grammar starts kept, the least recently asked for dropped first
FEWEST_BUDGET = 40_000  # matcher work the search for the fewest tokens may spend on one grammar
PREPARING_THREADS = 2  # so that a cheap grammar need not wait behind a costly one


class GrammarError(ValueError):
    """The request's grammar cannot be compiled, or broke while generating."""


@dataclass(frozen=True)
class Vocabulary:
    """The engine's tokens as the grammars see them."""

    tokenizer: LLTokenizer
    byte_tokens: ByteTokens
    ends: frozenset[int]
    token_bytes: list[bytes]  # each token's bytes, by id

    @classmethod
    def of(cls, tokenizer: LLTokenizer, ends: frozenset[int]) -> Vocabulary:
        token_bytes = [tokenizer.decode_bytes([token]) for token in range(tokenizer.vocab_size)]
        return cls(tokenizer, ByteTokens(tokenizer), ends, token_bytes)


@dataclass(frozen=True)
class GrammarStart:
    """A grammar as each row of it starts: `matcher` at the start, which a row copies and never changes;
    `ending`, the tokens that close its document from there (None: none found, the rows are not closed);
    `at_least`, the tokens every document takes at least (the ending's own count where it is proven the
    shortest). `error`: why the grammar cannot be used (then nothing else is set)."""

    vocabulary: Vocabulary
    matcher: LLMatcher | None
    ending: Ending | None = None
    at_least: int = 0
    error: str | None = None

    @property
    def proven_shortest(self) -> bool:
        return self.ending is not None and self.at_least == len(self.ending.tokens)


class GrammarStarts:
    """The engine's grammar starts (module docstring): computed on its own threads, kept by grammar."""

    def __init__(self, model_dir: Path, eos_token_ids: frozenset[int], counters: BatcherCounters) -> None:
        self._model_dir = model_dir
        self._eos = eos_token_ids
        self._counters = counters
        self._lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None
        self._kept: OrderedDict[tuple[str, str], Future[GrammarStart]] = OrderedDict()
        self._pool = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="grammar-start")

    def prepare(self, guidance: tuple[str, str], ready: Callable[[GrammarStart], None]) -> None:
        """Calls `ready` with the start of `guidance` (kind, grammar): at once where it is known, else from
        a preparing thread when its one computation ends."""
        with self._lock:
            start = self._kept.get(guidance)
            if start is None:
                start = self._kept[guidance] = self._pool.submit(self._compute, *guidance)
                if len(self._kept) > CACHED_GRAMMARS:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(guidance)
                self._counters.grammar_starts_reused += 1
        start.add_done_callback(lambda done: None if done.cancelled() else ready(done.result()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compute(self, kind: str, grammar: str) -> GrammarStart:
        vocabulary = self._vocabulary_once()
        with self._lock:
            self._counters.grammar_starts += 1
        try:
            return grammar_start(vocabulary, kind, grammar)
        except Exception as e:  # a fault of ours, not the request's: its job fails, the engine goes on
            logger.exception("the start of a %s could not be computed", kind)
            error = f"response_format: the {kind} could not be prepared: {e}"
            return GrammarStart(vocabulary, None, error=error)

    def _vocabulary_once(self) -> Vocabulary:
        with self._lock:
            if self._vocabulary is None:
                tokenizer = LLTokenizer(str(self._model_dir / "tokenizer.json"), eos_token=sorted(self._eos))
                self._vocabulary = Vocabulary.of(tokenizer, self._eos)
            return self._vocabulary


def grammar_start(vocabulary: Vocabulary, kind: str, grammar: str) -> GrammarStart:
    """The start of one grammar (GrammarStart), computed here and now."""
    try:
        matcher = compile_matcher(vocabulary.tokenizer, kind, grammar)
    except GrammarError as e:
        return GrammarStart(vocabulary, None, error=str(e))
    json = kind == "json_schema"
    walked = first_ending(matcher, vocabulary.byte_tokens, json)
    # a shorter ending than the walk's, or the proof that there is none
    limit = WALK_LIMIT if walked is None else len(walked.tokens) - 1
    keys = JsonKeys() if json else None
    ends = frozenset(token for token in vocabulary.ends if token < len(vocabulary.token_bytes))
    fewest = fewest_tokens(matcher, vocabulary.token_bytes, ends, keys, limit, WalkBudget(FEWEST_BUDGET))
    if fewest.tokens is not None:
        text = b"".join(vocabulary.token_bytes[token] for token in fewest.tokens)
        return GrammarStart(vocabulary, matcher, Ending(fewest.tokens, text), len(fewest.tokens))
    return GrammarStart(vocabulary, matcher, walked, fewest.at_least)


def compile_matcher(tokenizer: LLTokenizer, kind: str, grammar: str) -> LLMatcher:
    """A matcher of the grammar at its start; GrammarError where llguidance refuses it."""
    try:
        if kind == "json_schema":
            compiled = LLMatcher.grammar_from_json_schema(grammar)
        elif kind == "regex":
            compiled = LLMatcher.grammar_from_regex(grammar)
        else:
            compiled = LLMatcher.grammar_from_lark(grammar)
    except ValueError as e:
        raise GrammarError(grammar_refused(kind, str(e))) from e
    matcher = LLMatcher(tokenizer, compiled, log_level=0)
    if matcher.is_error():
        raise GrammarError(grammar_refused(kind, matcher.get_error()[:500]))
    return matcher
