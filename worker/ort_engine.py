"""ONNX Runtime GenAI's engine, driven by the one thread that creates it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime_genai as og

from common.error_codes import ErrorCode
from worker.device import Device
from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream, deliver_all
from worker.engine_thread import EngineThread

if TYPE_CHECKING:
    from llguidance import LLTokenizer

logger = logging.getLogger(__name__)

_TOKEN = og.EngineEventFlags.TOKEN.value
_FINISHED = og.EngineEventFlags.TURN_FINISHED.value
_FAILED = og.EngineEventFlags.FAILED.value
_ENGINE_FAILURE = og.EngineErrorCode.ENGINE_EXECUTION_FAILURE
# How the engine's llguidance says a request's grammar broke a step (the failure's cause).
_GRAMMAR_FAILURES = ("Error committing tokens", "parser error", "lexer error", "grammar")

_FINISH = {
    og.FinishReason.EOS: Finish.eos,
    og.FinishReason.STOP_STRING: Finish.stop_string,
    og.FinishReason.MAX_GENERATED_TOKENS: Finish.length,
    og.FinishReason.MAX_SESSION_TOKENS: Finish.length,
    og.FinishReason.CANCELLED: Finish.cancelled,
    og.FinishReason.FAILED: Finish.error,
}


class GuidanceRejected(ValueError):
    """The engine could not compile a request's structured-output grammar."""


def guide_turn(options: og.TurnOptions, guidance: tuple[str, str] | None) -> None:
    """Constrains a turn to the request's grammar (compiled when the turn begins: see grammar_errors)."""
    if guidance is not None:
        options.set_guidance(*guidance)


@contextlib.contextmanager
def grammar_errors(guidance: tuple[str, str] | None) -> Iterator[None]:
    """Turns the engine's refusal of a request's grammar into GuidanceRejected, naming what it is."""
    try:
        yield
    except Exception as e:
        if guidance is None or "grammar" not in str(e):
            raise
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:500]
        raise GuidanceRejected(f"response_format: the engine cannot use this {guidance[0]}: {detail}") from e


def failure_cause(error: str) -> str:
    """The engine's failure in one line: its cause, without llguidance's parser state."""
    cause = error.split("<state>")[0].split("Cause:", 1)[-1]
    return " ".join(line.strip() for line in cause.splitlines() if line.strip())[:500]


def load_config(model_dir: Path, device: Device, max_batch_size: int | None) -> og.Config:
    config = og.Config(str(model_dir))
    config.clear_providers()
    if device.kind == "cuda":
        config.append_provider("cuda")
        config.set_provider_option("cuda", "device_id", str(device.index or 0))
    if max_batch_size is not None:
        section = "dynamic_batching" if uses_dynamic_batching(model_dir) else "static_batching"
        config.overlay(json.dumps({"engine": {section: {"max_batch_size": max_batch_size}}}))
    return config


def uses_dynamic_batching(model_dir: Path) -> bool:
    genai = json.loads((model_dir / "genai_config.json").read_text())
    return "dynamic_batching" in genai.get("engine", {})


def context_length(model_dir: Path) -> int:
    genai = json.loads((model_dir / "genai_config.json").read_text())
    try:
        return int(genai["model"]["context_length"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{model_dir}/genai_config.json has no model.context_length") from e


def vocab_size(model_dir: Path) -> int | None:
    genai = json.loads((model_dir / "genai_config.json").read_text())
    size = genai.get("model", {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def sampling_options(request: GenerationRequest, vocab: int | None) -> tuple[bool, int]:
    """Whether the request samples (GenerationRequest.samples: the engine refuses sampling options
    beside a temperature of 0), and its top_k as the engine takes it: a top_k of at least the vocabulary
    is no bound (the engine refuses one above it)."""
    sampling = request.samples
    top_k = request.top_k if vocab is None or request.top_k < vocab else 0
    return sampling, top_k


class OrtTokenizer:
    def __init__(self, source: og.Model | og.Config, vocab: int | None, model_dir: Path) -> None:
        self._tokenizer = og.Tokenizer(source)
        self._vocab_size = vocab
        self._model_dir = model_dir
        self._byte_tokenizer: LLTokenizer | None = None

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (a byte-level token can hold part of a character), read from the model
        folder's tokenizer.json by llguidance the first time it is asked."""
        if self._byte_tokenizer is None:
            from llguidance import LLTokenizer

            self._byte_tokenizer = LLTokenizer(str(self._model_dir / "tokenizer.json"))
        return self._byte_tokenizer.decode_bytes([token])

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def apply_chat_template(self, messages_json: str) -> str:
        return str(self._tokenizer.apply_chat_template(messages_json, add_generation_prompt=True))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(np.asarray(token_ids, dtype=np.int32)))

    def stream_decoder(self) -> og.TokenizerStream:
        return self._tokenizer.create_stream()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(int(t) for t in self._tokenizer.eos_token_ids)


@dataclass
class _SoloRun:
    """A request on a generator of its own, outside og.Engine's batch: a seeded sampling request on the
    static scheduler (which cannot seed a turn), and a resumed request, whose replay needs the
    generator's one-token steps."""

    stream: GenerationStream
    generator: og.Generator
    produced: int = 0  # tokens after the replayed ones
    replayed: int = 0
    exact: bool = True

    @property
    def replaying(self) -> bool:
        return self.replayed < len(self.stream.request.replay_ids)


class OrtEngine(EngineThread):
    """Owns og.Model and og.Engine on a dedicated thread; asyncio code talks to it through queues."""

    def __init__(
        self, model_dir: Path, device: Device, max_batch_size: int | None = None, step_delay_s: float = 0.0
    ) -> None:
        self._step_delay_s = step_delay_s
        self.continuous_batching = uses_dynamic_batching(model_dir)
        self.exposes_logits = False
        self.prefix_block_tokens = 0  # og.Engine's own prefix caching (paged models) is not reported
        self.replays_guidance = False  # og's grammar starts again from its beginning
        self.handles_stop_strings = self.continuous_batching  # only og.Engine's dynamic batching does
        self.context_length = context_length(model_dir)
        self._vocab_size = vocab_size(model_dir)
        self._commands: queue.SimpleQueue[tuple[str, list[GenerationStream]]] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._model_dir = model_dir
        self._device = device
        self._max_batch_size = max_batch_size
        self.capacity = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.tokenizer: OrtTokenizer
        # Called in the event loop when og.Engine fails and can run nothing more (see restart).
        self.on_failure: Callable[[str], None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._failed: str | None = None  # the engine thread's: why og.Engine is unusable
        self._restarted: concurrent.futures.Future[None] | None = None
        self._thread = threading.Thread(target=self._main, name="ort-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _main(self) -> None:
        try:
            config = load_config(self._model_dir, self._device, self._max_batch_size)
            self._model = og.Model(config)
            self.tokenizer = OrtTokenizer(self._model, self._vocab_size, self._model_dir)
            self.eos_token_ids = self.tokenizer.eos_token_ids
            self._new_engine()
            self.capacity = int(self._engine.get_capabilities().configured_max_batch_size) or 1
        except BaseException as e:  # handed to the constructor's caller
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException:
            logger.exception("the engine thread died")
            raise

    def _new_engine(self) -> None:
        self._engine = og.Engine(self._model)
        self._buffer = self._engine.create_event_buffer(max(64, 4 * self.capacity))

    def _loop(self) -> None:
        self._active: dict[Any, tuple[GenerationStream, int]] = {}
        self._solo: list[_SoloRun] = []
        while True:
            busy = not self._failed and (self._engine.has_pending_requests() or bool(self._solo))
            if not self._drain_commands(block=not busy):
                return
            if self._failed:
                continue
            if self._engine.has_pending_requests():
                self._step()
            if self._solo:
                self._step_solo()
            if self._step_delay_s and busy:
                time.sleep(self._step_delay_s)

    def _drain_commands(self, *, block: bool) -> bool:
        try:
            command, streams = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command == "stop":
                return False
            if command == "restart":
                self._restart()
            for stream in streams:
                if command == "submit" and self._failed:
                    stream.deliver(EngineUpdate([], Finish.lost, self._failed))
                elif command == "submit":
                    self._start(stream)
                else:
                    self._stop(stream)
            try:
                command, streams = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _start(self, stream: GenerationStream) -> None:
        request = stream.request
        sampling, top_k = sampling_options(request, self._vocab_size)
        try:
            if request.replay_ids or (sampling and request.seed is not None and not self.continuous_batching):
                self._solo.append(_SoloRun(stream, self._solo_generator(request, sampling, top_k)))
                return
            og_request = self._engine.create_request()
            options = og.TurnOptions(og_request)
            options.set_max_generated_tokens(request.max_new_tokens)
            if request.min_new_tokens:
                options.set_min_generated_tokens(request.min_new_tokens)
            options.set_do_sample(sampling)
            if sampling:
                options.set_temperature(request.temperature)
                options.set_top_p(request.top_p)
                if top_k:
                    options.set_top_k(top_k)
                if (seed := request.engine_seed) is not None:
                    options.set_seed(seed)
            if request.stop and self.continuous_batching:
                options.set_stop_strings(request.stop)
            if request.repetition_penalty != 1.0:
                options.set_repetition_penalty(request.repetition_penalty)
            guide_turn(options, request.guidance)
            with grammar_errors(request.guidance):
                turn = og_request.begin_turn(np.asarray(request.prompt_ids, dtype=np.int32), options)
        except GuidanceRejected as e:
            stream.deliver(
                EngineUpdate([], Finish.error, str(e), error_code=ErrorCode.invalid_response_format)
            )
            return
        except Exception as e:
            stream.deliver(EngineUpdate([], Finish.error, f"the engine refused the request: {e}"))
            return
        self._active[og_request] = (stream, int(turn))

    def _solo_generator(self, request: GenerationRequest, sampling: bool, top_k: int) -> og.Generator:
        before = len(request.prompt_ids) + len(request.replay_ids)
        options: dict[str, Any] = {
            "do_sample": sampling,
            "max_length": min(self.context_length, before + request.max_new_tokens),
        }
        if sampling:
            options.update(temperature=request.temperature, top_p=request.top_p)
            if (seed := request.engine_seed) is not None:
                options["random_seed"] = seed
            if top_k:
                options["top_k"] = top_k
        if request.min_new_tokens:
            options["min_length"] = before + request.min_new_tokens
        if request.repetition_penalty != 1.0:
            options["repetition_penalty"] = request.repetition_penalty
        params = og.GeneratorParams(self._model)
        params.set_search_options(**options)
        with grammar_errors(request.guidance):
            if request.guidance is not None:
                params.set_guidance(*request.guidance)
            generator = og.Generator(self._model, params)
            generator.append_tokens(np.asarray(request.prompt_ids, dtype=np.int32))
        return generator

    def _stop(self, stream: GenerationStream) -> None:
        for og_request, (active, turn) in self._active.items():
            if active is stream:
                og_request.cancel_turn(turn)
                return
        for run in self._solo:
            if run.stream is stream:
                self._solo.remove(run)
                stream.deliver(EngineUpdate([], Finish.cancelled))
                return

    def _step(self) -> None:
        try:
            events = list(self._engine.run(self._buffer))
        except Exception as e:
            self._fail(str(e), [stream for stream, _turn in self._active.values()])
            return
        if any(int(e.flags.value) & _FAILED and e.error_code == _ENGINE_FAILURE for e in events):
            error = self._health_error()
            if error is not None:  # og.Engine is done for: no request of it can go on
                failed = [self._active[e.request][0] for e in events if e.request in self._active]
                self._fail(error, failed)
                return
        rows = len({e.request for e in events}) + len(self._solo)
        tokens: dict[Any, list[int]] = {}
        updates: list[tuple[GenerationStream, EngineUpdate]] = []
        for event in events:
            flags = int(event.flags.value)
            if flags & _TOKEN:
                tokens.setdefault(event.request, []).append(int(event.token))
            if flags & (_FINISHED | _FAILED):
                entry = self._active.pop(event.request, None)
                if entry is None:
                    continue
                stream, _turn = entry
                finish = Finish.error if flags & _FAILED else _FINISH.get(event.finish_reason, Finish.eos)
                error = f"engine error {event.error_code.name}" if finish is Finish.error else None
                updates.append((stream, EngineUpdate(tokens.pop(event.request, []), finish, error, rows)))
                event.request.close()
        for og_request, ids in tokens.items():
            entry = self._active.get(og_request)
            if entry is not None:
                updates.append((entry[0], EngineUpdate(ids, batch_rows=rows)))
        deliver_all(updates)  # one wake-up of the event loop per step

    def _health_error(self) -> str | None:
        """og.Engine's error when it can take no more requests (it rethrows its failure), else None."""
        try:
            self._engine.create_request().close()
        except Exception as e:
            return str(e)
        return None

    def _fail(self, error: str, failed: list[GenerationStream]) -> None:
        """og.Engine failed for good. The request that broke it ends with the error: the guided requests
        among those it failed when the cause is a grammar (invalid_response_format), else those it failed.
        Every other request it held, and every solo run, ends `lost`: its job goes back to the queue."""
        cause = failure_cause(error)
        logger.error("the engine failed and can run nothing more: %s", cause)
        guided = [stream for stream in failed if stream.request.guidance is not None]
        updates: list[tuple[GenerationStream, EngineUpdate]] = []
        if guided and any(marker in error for marker in _GRAMMAR_FAILURES):
            for stream in guided:
                assert stream.request.guidance is not None
                kind = stream.request.guidance[0]
                message = f"response_format: the engine failed on this {kind} while generating ({cause})"
                code = ErrorCode.invalid_response_format
                updates.append((stream, EngineUpdate([], Finish.error, message, error_code=code)))
            culprits = guided
        else:
            culprits = failed
            message = f"the engine failed while generating ({cause})"
            updates += [(stream, EngineUpdate([], Finish.error, message)) for stream in failed]
        held = [stream for stream, _turn in self._active.values()] + [run.stream for run in self._solo]
        lost = [stream for stream in held if not any(stream is culprit for culprit in culprits)]
        updates += [(stream, EngineUpdate([], Finish.lost, cause)) for stream in lost]
        for og_request in self._active:
            with contextlib.suppress(Exception):
                og_request.close()
        self._active.clear()
        self._solo.clear()
        self._failed = cause
        deliver_all(updates)
        self._tell_failure(cause)

    def _restart(self) -> None:
        restarted = self._restarted
        assert restarted is not None
        if self._failed is None:  # nothing to replace
            restarted.set_result(None)
            return
        try:
            self._engine = self._buffer = None  # the failed engine goes first, on its own thread
            self._new_engine()
        except Exception as e:
            logger.exception("a new og.Engine could not be made")
            restarted.set_exception(e)
            return
        self._failed = None
        logger.info("a new og.Engine serves the model")
        restarted.set_result(None)

    def _step_solo(self) -> None:
        rows = len(self._solo) + len(self._active)
        updates: list[tuple[GenerationStream, EngineUpdate]] = []
        for run in list(self._solo):
            try:
                update = self._replay_step(run) if run.replaying else self._solo_step(run, rows)
            except Exception as e:
                update = EngineUpdate([], Finish.error, f"generation failed: {e}", rows)
            if update is None:
                continue
            if update.finish is not None:
                self._solo.remove(run)
            updates.append((run.stream, update))
        deliver_all(updates)

    @staticmethod
    def _replay_step(run: _SoloRun) -> None:
        """One decode step of a replay: the step that first computed the replayed token, computed again.
        Should it give another token (a different batch, another device), the replayed token is put in
        its place, so the job continues from what its stream already holds."""
        generator = run.generator
        expected = run.stream.request.replay_ids[run.replayed]
        generator.generate_next_token()
        if int(generator.get_next_tokens()[0]) != expected:
            generator.rewind_to(generator.token_count() - 1)
            generator.append_tokens(np.asarray([expected], dtype=np.int32))
            run.exact = False
        run.replayed += 1
        return None

    def _solo_step(self, run: _SoloRun, rows: int) -> EngineUpdate:
        replayed = bool(run.stream.request.replay_ids) and run.produced == 0
        exact = run.exact if replayed else None
        run.generator.generate_next_token()
        token = int(run.generator.get_next_tokens()[0])
        run.produced += 1
        if token in self.eos_token_ids:
            return EngineUpdate([], Finish.eos, None, rows, replay_exact=exact)
        if run.produced >= run.stream.request.max_new_tokens or run.generator.is_done():
            return EngineUpdate([token], Finish.length, None, rows, replay_exact=exact)
        return EngineUpdate([token], None, None, rows, replay_exact=exact)
