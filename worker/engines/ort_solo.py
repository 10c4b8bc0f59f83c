"""Solo runs: requests on an og.Generator of their own, outside og.Engine's batch. A seeded sampling
request on the static scheduler (which cannot seed a turn), and a resumed request, whose replay needs the
generator's one-token steps. OrtEngine steps them on its thread, after each og.Engine step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime_genai as og

from worker.engine import EngineUpdate, Finish, GenerationRequest, GenerationStream
from worker.engines.engine_errors import grammar_errors


@dataclass
class SoloRun:
    stream: GenerationStream
    generator: og.Generator
    produced: int = 0  # tokens after the replayed ones
    replayed: int = 0
    exact: bool = True

    @property
    def replaying(self) -> bool:
        return self.replayed < len(self.stream.request.replay_ids)

    def step(self, rows: int, eos_token_ids: frozenset[int]) -> EngineUpdate | None:
        """One decode step: a replayed token (no update), else the next token, or the request's end."""
        if self.replaying:
            self._replay_step()
            return None
        return self._next(rows, eos_token_ids)

    def _replay_step(self) -> None:
        """One decode step of a replay: the step that first computed the replayed token, computed again.
        Should it give another token (a different batch, another device), the replayed token is put in
        its place, so the job continues from what its stream already holds."""
        generator = self.generator
        expected = self.stream.request.replay_ids[self.replayed]
        generator.generate_next_token()
        if int(generator.get_next_tokens()[0]) != expected:
            generator.rewind_to(generator.token_count() - 1)
            generator.append_tokens(np.asarray([expected], dtype=np.int32))
            self.exact = False
        self.replayed += 1

    def _next(self, rows: int, eos_token_ids: frozenset[int]) -> EngineUpdate:
        replayed = bool(self.stream.request.replay_ids) and self.produced == 0
        exact = self.exact if replayed else None
        self.generator.generate_next_token()
        token = int(self.generator.get_next_tokens()[0])
        self.produced += 1
        if token in eos_token_ids:
            return EngineUpdate([], Finish.eos, None, rows, replay_exact=exact)
        if self.produced >= self.stream.request.max_new_tokens or self.generator.is_done():
            return EngineUpdate([token], Finish.length, None, rows, replay_exact=exact)
        return EngineUpdate([token], None, None, rows, replay_exact=exact)


def solo_generator(
    model: og.Model, request: GenerationRequest, sampling: bool, top_k: int, context_length: int
) -> og.Generator:
    """A generator for the request, its prompt in (`sampling`, `top_k`: as the engine takes them)."""
    before = len(request.prompt_ids) + len(request.replay_ids)
    options: dict[str, Any] = {
        "do_sample": sampling,
        "max_length": min(context_length, before + request.max_new_tokens),
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
    params = og.GeneratorParams(model)
    params.set_search_options(**options)
    with grammar_errors(request.guidance):
        if request.guidance is not None:
            params.set_guidance(*request.guidance)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray(request.prompt_ids, dtype=np.int32))
    return generator
