"""What the batcher has run since it started, for the worker's metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatcherCounters:
    """Written by the batcher's thread (the grammar starts' by their own threads), read from any thread."""

    prefill_tokens: int = 0  # prompt tokens through the graph
    prefill_runs: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0  # rows over all decode steps
    prefix_tokens_queried: int = 0  # prompt tokens of the requests admitted with the prefix cache on
    prefix_hits: int = 0  # requests that started from a cached prompt prefix
    prefix_tokens_reused: int = 0  # prompt tokens those requests did not prefill
    grammar_starts: int = 0  # grammars whose start was computed (grammar_starts.py)
    grammar_starts_reused: int = 0  # structured requests that started from one computed before
