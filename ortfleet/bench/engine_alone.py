"""The serving bench's baseline: the engine alone, one og.Generator per request in this process."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.completions import Planned, Served, level_figures


def engine_alone(model_dir: Path, planned: list[Planned]) -> dict[str, Any]:
    """One og.Generator per request, one request after another; its KV sized to the request."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    tokenizer = og.Tokenizer(model)

    def one(request: Planned) -> Served:
        ids = np.asarray(tokenizer.encode(request.prompt), dtype=np.int32)
        length = len(ids) + request.max_tokens
        params = og.GeneratorParams(model)  # end of sequence masked: exactly max_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        generator = og.Generator(model, params)
        begun = time.perf_counter()
        generator.append_tokens(ids)
        times = []
        for _ in range(request.max_tokens):
            if generator.is_done():
                break
            generator.generate_next_token()
            times.append(time.perf_counter())
        del generator
        if not times:
            raise RuntimeError(f"request {request.index}: the generator was done before its first token")
        gaps = [b - a for a, b in itertools.pairwise(times)]
        ttft = times[0] - begun
        return Served(request.index, request.max_tokens, begun, ttft, times[-1], len(times), gaps, len(ids))

    one(Planned(-1, PROMPTS[0], 8))  # warm-up: first runs pay for allocations, not measured
    started = time.perf_counter()
    results = [one(request) for request in planned]
    wall = time.perf_counter() - started
    return level_figures(results, wall)
