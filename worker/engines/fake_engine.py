"""A stand-in engine with a set speed and capacity: worker logic without a model, fleet simulations.

It batches continuously: every `delay_s` each active request gets one token, and a request
submitted between steps joins at the next one. Text is byte-level; the generated token at
absolute position p (prompt included) is the letter ``"abcdefghijklmnopqrstuvwxyz"[p % 26]``, so a
job resumed from its published tokens continues exactly where the first attempt stopped.

Stop strings go as on og.Engine's dynamic batching: the engine ends a request with the token that
completes one (continuous batching only), and the job runner, which matches the stops on the text,
cuts the stop text from the output (or keeps it, with include_stop_str_in_output).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream

EOS = 256
_A = ord("a")


def fake_engine_is_static(spec: str) -> bool:
    """`DELAY_MS:CAPACITY:static` acts as the static scheduler (batches run to their end)."""
    return spec.endswith(":static")


def parse_fake_engine(spec: str) -> tuple[float, int]:
    """`DELAY_MS:CAPACITY[:static]` (e.g. `20:4`) -> (seconds per step, batch rows)."""
    try:
        delay, capacity = spec.removesuffix(":static").split(":")
        delay_s, rows = float(delay) / 1000, int(capacity)
    except ValueError as e:
        raise ValueError(f"--fake-engine: {spec!r} is not DELAY_MS:CAPACITY, e.g. 20:4") from e
    if delay_s <= 0 or rows < 1:
        raise ValueError(f"--fake-engine: {spec!r} needs a positive delay and a capacity of at least 1")
    return delay_s, rows


class FakeDecoder:
    def decode(self, token_id: int) -> str:
        return chr(token_id) if token_id < EOS else ""


class FakeTokenizer:
    vocab_size = EOS + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages_json: str) -> str:
        messages = json.loads(messages_json)
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def stream_decoder(self) -> FakeDecoder:
        return FakeDecoder()

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < EOS).decode(errors="replace")


@dataclass
class _Active:
    stream: GenerationStream
    produced: int = 0
    tail: str = ""  # the last letters generated, as many as the longest stop string has


class FakeEngine:
    """Implements worker.engine.Engine on the event loop: one token per active request per step."""

    def __init__(
        self,
        delay_s: float,
        capacity: int,
        *,
        context_length: int = 8192,
        eos_after: int | None = None,
        continuous_batching: bool = True,
    ) -> None:
        """`eos_after`: end each request with end of sequence after that many tokens (default: never).
        `continuous_batching=False` makes the worker treat it like the static scheduler: it claims
        only between batches, and a stop string ends a request only when the worker cancels it."""
        self.continuous_batching = continuous_batching
        self.exposes_logits = False
        self.prefix_block_tokens = 0
        self.replays_guidance = False  # og's grammar starts again from its beginning
        self.closes_documents = False  # it follows no grammar
        self.handles_stop_strings = False  # the job runner cuts the stop text, as for og.Engine
        self.delay_s = delay_s
        self.capacity = capacity
        self.context_length = context_length
        self.eos_token_ids = frozenset({EOS})
        self.tokenizer = FakeTokenizer()
        self._eos_after = eos_after
        self.on_failure: Callable[[str], None] | None = None
        self.failed: str | None = None  # see fail
        self.restart_error: Exception | None = None  # what restart raises, if anything
        self._active: list[_Active] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(self, requests: list[GenerationRequest]) -> list[GenerationStream]:
        loop = asyncio.get_running_loop()
        streams = [GenerationStream(request=request, loop=loop) for request in requests]
        for stream in streams:
            if self.failed is not None:
                stream.deliver(EngineUpdate([], Finish.lost, self.failed))
            elif len(stream.request.prompt_ids) >= self.context_length:
                stream.deliver(EngineUpdate([], Finish.error, "the prompt does not fit the context"))
            else:
                self._active.append(_Active(stream))
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="fake-engine")
        assert self._wake is not None
        self._wake.set()
        return streams

    def cancel(self, stream: GenerationStream) -> None:
        stream.cancel_requested = True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def fail(self, cause: str) -> None:
        """Fails as og.Engine does for good: the oldest request ends with the error, the others `lost`,
        and every request is lost until `restart`."""
        ended, self._active = self._active, []
        for i, active in enumerate(ended):
            update = EngineUpdate([], Finish.error if i == 0 else Finish.lost, cause)
            active.stream.updates.put_nowait(update)
        self.failed = cause
        if self.on_failure is not None:
            self.on_failure(cause)

    async def restart(self) -> None:
        if self.restart_error is not None:
            raise self.restart_error
        self.failed = None

    async def aclose(self) -> None:
        self.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
            due += self.delay_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = max(due, loop.time() - self.delay_s)  # a late step is not made up by a burst
            self._step()

    def _step(self) -> None:
        rows = len(self._active)
        for active in list(self._active):
            update = self._next(active, rows)
            if update.finish is not None:
                self._active.remove(active)
            active.stream.updates.put_nowait(update)

    def _next(self, active: _Active, rows: int) -> EngineUpdate:
        request = active.stream.request
        if active.stream.cancel_requested:
            return EngineUpdate([], Finish.cancelled, batch_rows=rows)
        if self._eos_after is not None and active.produced >= max(self._eos_after, request.min_new_tokens):
            return EngineUpdate([], Finish.eos, batch_rows=rows)
        position = len(request.prompt_ids) + len(request.replay_ids) + active.produced
        active.produced += 1
        token = _A + position % 26
        finish = Finish.length if active.produced >= request.max_new_tokens else None
        if (
            finish is None
            and self.continuous_batching
            and request.stop
            and _ends_at_stop(active, token, request.stop)
        ):
            finish = Finish.stop_string
        return EngineUpdate([token], finish, batch_rows=rows)


def _ends_at_stop(active: _Active, token: int, stop: list[str]) -> bool:
    """Whether the letters generated so far end with one of the request's stop strings: a stop string
    first appears with the letter that ends it, so only the last few letters are kept and looked at."""
    active.tail = (active.tail + chr(token))[-max(map(len, stop)) :]
    return any(active.tail.endswith(s) for s in stop)
