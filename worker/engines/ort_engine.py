"""ONNX Runtime GenAI's engine, driven by the one thread that creates it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og

from common.error_codes import ErrorCode
from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream, deliver_all
from worker.engines.device import Device
from worker.engines.engine_errors import GuidanceRejected, failure_cause, grammar_broke, grammar_errors
from worker.engines.engine_thread import EngineThread, Updates
from worker.engines.genai_config import (
    context_length,
    load_config,
    read_genai,
    uses_dynamic_batching,
    vocab_size,
)
from worker.engines.ort_solo import SoloRun, solo_generator
from worker.engines.ort_tokenizer import OrtTokenizer
from worker.engines.row_sizing import KvPlan, RowSizing, calibrate, gpu_memory, plan_kv, weights_bytes

logger = logging.getLogger(__name__)

_TOKEN = og.EngineEventFlags.TOKEN.value
_FINISHED = og.EngineEventFlags.TURN_FINISHED.value
_FAILED = og.EngineEventFlags.FAILED.value
_ENGINE_FAILURE = og.EngineErrorCode.ENGINE_EXECUTION_FAILURE
_PROBE_STEPS = 12  # decode steps of each row count row sizing times
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


def sampling_options(request: GenerationRequest, vocab: int | None) -> tuple[bool, int]:
    """Whether the request samples (GenerationRequest.samples: the engine refuses sampling options
    beside a temperature of 0), and its top_k as the engine takes it: a top_k of at least the vocabulary
    is no bound (the engine refuses one above it)."""
    sampling = request.samples
    top_k = request.top_k if vocab is None or request.top_k < vocab else 0
    return sampling, top_k


class OrtEngine(EngineThread):
    """Owns og.Model and og.Engine on a dedicated thread; asyncio code talks to it through queues."""

    def __init__(
        self,
        model_dir: Path,
        device: Device,
        max_batch_size: int | None = None,
        step_delay_s: float = 0.0,
        *,
        target_itl_ms: float | None = None,
        gpu_kv_fraction: float | None = None,
        prefix_caching: bool = False,
        cuda_graph: str = "auto",
    ) -> None:
        super().__init__("ort-engine")
        self._cuda_graph = cuda_graph  # ORTFLEET_CUDA_GRAPH: see genai_config.cuda_provider_options
        self._target_itl_ms = target_itl_ms
        self._gpu_kv_fraction = gpu_kv_fraction
        self._prefix_caching = prefix_caching
        # On a GPU with dynamic batching and no max_batch_size given: the rows sized from the card.
        self.row_sizing: RowSizing | None = None
        self._step_delay_s = step_delay_s
        self.continuous_batching = uses_dynamic_batching(model_dir)
        self.exposes_logits = False
        self.prefix_block_tokens = 0  # og.Engine's own prefix caching (paged models) is not reported
        self.replays_guidance = False  # og's grammar starts again from its beginning
        self.closes_documents = False  # og runs its own sampler: a cut document stays cut
        # og.Engine's dynamic batching ends a request at a stop string, but leaves the stop text in its
        # tokens: the job runner matches the stops on the text and cuts it (the engine still stops early).
        self.handles_stop_strings = False
        self.context_length = context_length(model_dir)
        self._vocab_size = vocab_size(model_dir)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._model_dir = model_dir
        self._device = device
        self._max_batch_size = max_batch_size
        self.capacity = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.tokenizer: OrtTokenizer
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _main(self) -> None:
        try:
            kv_plan = self._kv_plan()
            batching = engine_batching(self._model_dir, kv_plan, self._max_batch_size, self._prefix_caching)
            config = load_config(self._model_dir, self._device, batching, cuda_graph=self._cuda_graph)
            self._model = og.Model(config)
            self.tokenizer = OrtTokenizer(self._model, self._vocab_size, self._model_dir)
            self.eos_token_ids = self.tokenizer.eos_token_ids
            self._new_engine()
            self.capacity = int(self._engine.get_capabilities().configured_max_batch_size) or 1
            if kv_plan is not None and self._max_batch_size is None:
                self._size_rows(kv_plan)
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

    def _kv_plan(self) -> KvPlan | None:
        """On a GPU with dynamic batching: the KV cache and row ceiling the card allows (row_sizing)."""
        if self._device.kind != "cuda" or not self.continuous_batching:
            return None
        memory = gpu_memory(self._device.gpu_label)
        total, free = memory if memory is not None else (None, None)
        return plan_kv(
            read_genai(self._model_dir),
            self.context_length,
            total,
            free,
            weights_bytes(self._model_dir),
            self._gpu_kv_fraction,
        )

    def _size_rows(self, kv_plan: KvPlan) -> None:
        """The rows to serve with: the most whose decode step stays within the target ITL (row_sizing)."""
        sizing = RowSizing(kv_plan, self._target_itl_ms)
        if self._target_itl_ms is None:
            sizing.rows = self.capacity
        else:
            try:
                rows, sizing.timings = calibrate(self.capacity, self._target_itl_ms, self._decode_step_ms)
            except Exception:  # a probe the engine refused: serve with the ceiling rather than not at all
                logger.exception(
                    "timing decode steps failed; serving with the KV memory's %d rows", self.capacity
                )
                rows = self.capacity
            sizing.rows = rows
        self.capacity = sizing.rows
        self.row_sizing = sizing
        logger.info("rows sized from the card: %s", sizing.describe())

    def _decode_step_ms(self, rows: int) -> float:
        """The median time of og.Engine's steps while `rows` greedy requests all decode together."""
        prompt = np.asarray(self.tokenizer.encode("Tell me a story about the sea.")[:16], dtype=np.int32)
        requests = []
        for _ in range(rows):
            request = self._engine.create_request()
            options = og.TurnOptions(request)
            options.set_max_generated_tokens(_PROBE_STEPS)
            options.set_min_generated_tokens(_PROBE_STEPS)
            options.set_do_sample(False)
            request.begin_turn(prompt, options)
            requests.append(request)
        durations = []
        try:
            while self._engine.has_pending_requests():
                began = time.perf_counter()
                events = list(self._engine.run(self._buffer))
                elapsed = time.perf_counter() - began
                tokens = sum(1 for e in events if int(e.flags.value) & _TOKEN)
                if tokens == rows:  # every row decoded in this step (no prefill in it)
                    durations.append(elapsed)
        finally:
            for request in requests:
                with contextlib.suppress(Exception):
                    request.close()
        if not durations:
            return float("inf")
        durations.sort()
        return durations[len(durations) // 2] * 1000

    def _new_engine(self) -> None:
        self._engine = og.Engine(self._model)
        rows = int(self._engine.get_capabilities().configured_max_batch_size) or 1
        self._buffer = self._engine.create_event_buffer(max(64, 4 * rows))  # a whole step's events

    def _loop(self) -> None:
        self._active: dict[Any, tuple[GenerationStream, int]] = {}
        self._solo: list[SoloRun] = []
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

    def _start(self, stream: GenerationStream, updates: Updates) -> None:
        request = stream.request
        sampling, top_k = sampling_options(request, self._vocab_size)
        try:
            if not self.continuous_batching and (
                request.replay_ids or (sampling and request.seed is not None)
            ):
                generator = solo_generator(self._model, request, sampling, top_k, self.context_length)
                self._solo.append(SoloRun(stream, generator))
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
            if request.guidance is not None:  # compiled when the turn begins
                options.set_guidance(*request.guidance)
            with grammar_errors(request.guidance):
                # og.Generator refuses paged models: a resumed request prefills its replayed tokens
                # after the prompt (resume_mode prefill), and continues from them.
                prompt = [*request.prompt_ids, *request.replay_ids]
                turn = og_request.begin_turn(np.asarray(prompt, dtype=np.int32), options)
        except GuidanceRejected as e:
            code = ErrorCode.invalid_response_format
            updates.append((stream, EngineUpdate([], Finish.error, str(e), error_code=code)))
            return
        except Exception as e:
            updates.append((stream, EngineUpdate([], Finish.error, f"the engine refused the request: {e}")))
            return
        self._active[og_request] = (stream, int(turn))

    def _cancel(self, stream: GenerationStream, updates: Updates) -> None:
        for og_request, (active, turn) in self._active.items():
            if active is stream:
                og_request.cancel_turn(turn)
                return
        for run in self._solo:
            if run.stream is stream:
                self._solo.remove(run)
                updates.append((stream, EngineUpdate([], Finish.cancelled)))
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
        updates: Updates = []
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
        updates: Updates = []
        if guided and any(marker in error for marker in _GRAMMAR_FAILURES):
            for stream in guided:
                assert stream.request.guidance is not None
                kind = stream.request.guidance[0]
                message = grammar_broke(kind, cause)
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

    def _renew(self) -> None:
        self._engine = self._buffer = None  # the failed engine goes first, on its own thread
        try:
            self._new_engine()
        except Exception:
            logger.exception("a new og.Engine could not be made")
            raise
        logger.info("a new og.Engine serves the model")

    def _step_solo(self) -> None:
        rows = len(self._solo) + len(self._active)
        updates: Updates = []
        for run in list(self._solo):
            try:
                update = run.step(rows, self.eos_token_ids)
            except Exception as e:
                update = EngineUpdate([], Finish.error, f"generation failed: {e}", rows)
            if update is None:
                continue
            if update.finish is not None:
                self._solo.remove(run)
            updates.append((run.stream, update))
        deliver_all(updates)


def engine_batching(
    model_dir: Path, kv_plan: KvPlan | None, max_batch_size: int | None, prefix_caching: bool
) -> dict[str, Any]:
    """What the worker overlays on the model's engine batching section: the rows and KV blocks sized
    from the card, a max_batch_size given, and, on dynamic batching, og.Engine's prefix caching off
    unless asked for (its cache is shared by every request, whatever their keys) and the model allows it."""
    batching: dict[str, Any] = kv_plan.overlay() if kv_plan is not None else {}
    if max_batch_size is not None:
        batching["max_batch_size"] = max_batch_size
    if uses_dynamic_batching(model_dir):
        allowed = read_genai(model_dir)["engine"]["dynamic_batching"].get("prefix_caching", True)
        batching["prefix_caching"] = bool(prefix_caching and allowed)
    return batching
