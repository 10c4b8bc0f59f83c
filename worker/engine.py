"""What the worker needs from a generation engine, so job logic can run on a fake one in tests."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from common.error_codes import ErrorCode

SAMPLING_EPSILON = 1e-5  # a lower temperature samples greedily, as in vLLM
# The seeds both of og's ways to sample take: GeneratorParams' random_seed is an int32 (-1: unseeded),
# TurnOptions.set_seed an unsigned one. A job's seed (0 to 2**63 - 1) samples with seed mod 2**31, the
# same on every engine.
ENGINE_SEEDS = 2**31


class Finish(str, Enum):
    eos = "eos"
    stop_string = "stop_string"
    length = "length"
    cancelled = "cancelled"
    error = "error"
    lost = "lost"  # the engine failed under the request, through no fault of its own: the job goes back


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int = 0  # end of sequence is masked until this many tokens are generated
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None  # handed to the engine only when it supports stop strings
    repetition_penalty: float = 1.0
    guidance: tuple[str, str] | None = (
        None  # structured output: (json_schema | regex | lark_grammar, grammar)
    )
    # Tokens an earlier attempt generated after the prompt: the engine computes them again as they were
    # first computed (prompt prefill, then one decode step each) and delivers only the tokens after them.
    # max_new_tokens and min_new_tokens count from the end of the replayed tokens.
    replay_ids: tuple[int, ...] = ()
    # Structured output: the engine ends the document within max_tokens (worker/engines/batcher/closing.py),
    # on engines that can (`closes_documents`).
    close_early: bool = True
    # OpenAI's controls over the logits, only on engines that expose them (`exposes_logits`; og.Engine
    # does not). Log-probabilities of each generated token and of the `logprobs` likeliest at its step
    # (0: the token's alone), from the model's distribution before penalties, bias, masks and temperature.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit)
    # Log-probabilities of each prompt token after the first, and of the `prompt_logprobs` likeliest at its
    # place, on the request's first update; the prompt is then prefilled whole (no cached prefix).
    prompt_logprobs: int | None = None
    # Whose prompts' KV the request may reuse, and who may reuse its own: only requests of the same scope
    # (the job's cache_scope, gateway/cache_scope.py) share prompt prefixes.
    cache_scope: str = ""
    # Whose work the request is (the job's API key) and that key's fair-share weight: the engine divides
    # its time between keys by weight (worker/engines/work_shares.py), prefill included.
    owner: str = ""
    weight: float = 1.0
    # The LoRA adapter the request runs with, by the name the worker loaded it under (None: the base model);
    # only on engines that serve adapters (worker/engines/batcher/lora.py).
    adapter: str | None = None

    @property
    def samples(self) -> bool:
        """Whether the request samples rather than picks greedily: a temperature below SAMPLING_EPSILON
        is greedy (og holds it as a float32, where the tiniest are 0), and so is a top_k of 1."""
        return self.temperature >= SAMPLING_EPSILON and self.top_k != 1

    @property
    def engine_seed(self) -> int | None:
        """The seed the engine samples with (ENGINE_SEEDS)."""
        return None if self.seed is None else self.seed % ENGINE_SEEDS

    @property
    def needs_logits(self) -> str | None:
        """The first parameter set that only an engine exposing its logits can honour, if any."""
        if self.logprobs is not None:
            return "logprobs"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs"
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None


# Not frozen: an update is made for every row at every step, and a frozen dataclass takes five times as
# long to build (each field set through object.__setattr__). Nothing changes one once it is made.
@dataclass(slots=True)
class EngineUpdate:
    token_ids: list[int]
    finish: Finish | None = None
    error: str | None = None
    batch_rows: int = 1
    error_code: ErrorCode | None = None  # for programs, like invalid_response_format
    # On a request's first update after a replay: whether the replay reproduced every replayed token
    # (False: the engine computed another token somewhere and continued from the replayed one).
    replay_exact: bool | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one for each of token_ids, when asked for
    # On a request's first update, from engines that reuse prompt KV: the prompt tokens it reused.
    cached_tokens: int | None = None
    # On a request's first update, when it asked for them: one for each prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # On the last update: True, the engine overruled the model to end its structured document within
    # max_tokens (the text is complete; finish is eos); False, max_tokens cut a structured document
    # that asked to be closed and could not be (no ending found for its format); None otherwise.
    closed_early: bool | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # the generated token's
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), likeliest first


class UpdateQueue:
    """One request's engine updates, put in the event loop's thread. They are either taken one at a time
    (`get`), or handed to a consumer as they come (`consume`): a running job handles each engine step's
    tokens in the same event-loop wake-up, without a task switch per step."""

    __slots__ = ("_consumer", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[EngineUpdate] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._consumer: Callable[[EngineUpdate], None] | None = None

    def put_nowait(self, update: EngineUpdate) -> None:
        if self._consumer is not None:
            self._consumer(update)
            return
        self._items.append(update)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> EngineUpdate:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def consume(self, consumer: Callable[[EngineUpdate], None]) -> None:
        """From now on, every update goes to `consumer` when it is put (those waiting first). The
        consumer runs in the putter's call: it must not raise."""
        self._consumer = consumer
        while self._items:
            consumer(self._items.popleft())


@dataclass
class GenerationStream:
    """One request's updates, delivered from the engine thread into the event loop."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    updates: UpdateQueue = field(default_factory=UpdateQueue)
    cancel_requested: bool = False

    def deliver(self, update: EngineUpdate) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)


def deliver_all(updates: list[tuple[GenerationStream, EngineUpdate]]) -> None:
    """Hands one engine step's updates to the event loop with a single wake-up (not one per stream)."""
    if updates:
        updates[0][0].loop.call_soon_threadsafe(_put_all, updates)


def _put_all(updates: list[tuple[GenerationStream, EngineUpdate]]) -> None:
    for stream, update in updates:
        stream.updates.put_nowait(update)


class Engine(Protocol):
    capacity: int
    context_length: int
    continuous_batching: bool  # requests join a running batch (else: a batch runs to its end first)
    handles_stop_strings: bool  # the engine ends a request at its stop strings (else the job runner does)
    exposes_logits: bool  # the engine answers logprobs, presence and frequency penalties and logit_bias
    replays_guidance: bool  # a replay walks the request's grammar through the replayed tokens
    closes_documents: bool  # structured output ends within max_tokens (GenerationRequest.close_early)
    # Prompts of at least this many tokens leave their KV for later requests to reuse (0: none do).
    prefix_block_tokens: int
    eos_token_ids: frozenset[int]
    # Called in the event loop, with the cause, once the engine has failed and can run nothing more: it
    # has ended every request it held (see Finish.lost) and waits for `restart`.
    on_failure: Callable[[str], None] | None

    def submit(self, requests: list[GenerationRequest]) -> list[GenerationStream]:
        """Hands requests to the engine together, so a static batch starts with all of them."""
        ...

    def cancel(self, stream: GenerationStream) -> None: ...

    def close(self) -> None: ...

    async def restart(self) -> None:
        """A working engine again after a failure; raises when none can be made."""
        ...


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int | None:
        """How many token ids the model has (ids 0 to vocab_size - 1), when its folder says."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages_json: str) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token, which may be part of a character."""
        ...


class StreamDecoder(Protocol):
    def decode(self, token_id: int) -> str: ...
