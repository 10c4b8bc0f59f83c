"""The garbage collector of a long-running process, once what it loads at startup is loaded."""

from __future__ import annotations

import gc


def calm_garbage_collector(young_allocations: int) -> None:
    """Fewer, cheaper collections from now on: every object alive now (modules, the app, a model's session
    and tokenizer) moves to the permanent generation, so no collection walks it again, and the youngest
    generation is collected after `young_allocations` allocations rather than CPython's 700, so objects
    that live a little while (a step's rows, an open stream's buffers) are walked, and promoted towards the
    oldest generation, far less often. Objects made later are collected as before, cycles among them a
    little later."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(young_allocations, middle, oldest)
