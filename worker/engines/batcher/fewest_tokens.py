"""The fewest tokens a structured document can take from where its grammar stands, proven by search.

The walk (closing_walk.py) finds *a* short ending quickly, not the shortest: `[a-z]+(,[a-z]+)*\\.` walks to
`t,t,t,t,t.` where `a.` ends it. `fewest_tokens` searches breadth first over the model's own tokens, every
token the grammar allows at each state, level by level: the first accepting state it reaches is a shortest
ending, and every level it finishes proves that no document takes that few tokens. Two token sequences of
the same bytes leave the matcher in the same state (llguidance reads tokens as their bytes), so a state is
reached once. In JSON, a token that would give an object a key it already has is passed over, as the
sampler passes it over (json_keys.py).

The search pays from a `WalkBudget`, as the walk does: one that runs out has still proven its finished
levels, a lower bound that a refusal may rely on (`Fewest.at_least`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llguidance import LLMatcher

from worker.engines.batcher.closing_walk import MASK_COST, OverBudget, WalkBudget
from worker.engines.batcher.json_keys import JsonKeys

# A state reached (a copy of the matcher, a token consumed): about as much as 20 single-token checks.
_CHILD_COST = 20


class Fewest(NamedTuple):
    """What the search proved: `tokens`, a shortest ending when it reached one; else no ending takes fewer
    than `at_least` tokens."""

    tokens: list[int] | None
    at_least: int


def fewest_tokens(
    matcher: LLMatcher,
    token_bytes: list[bytes],
    ends: frozenset[int],
    keys: JsonKeys | None,
    limit: int,
    budget: WalkBudget,
) -> Fewest:
    """A shortest ending of at most `limit` tokens from the matcher's state (left as it was), or how many
    tokens every ending takes at least, as far as the budget let the search go. `token_bytes`: each token's
    bytes, by id."""
    if matcher.is_accepting():
        return Fewest([], 0)
    level: list[_Node] = [_Node(matcher, keys, [], b"")]
    seen: set[bytes] = {b""}
    depth = 0  # every ending takes more than `depth` tokens
    try:
        while level and depth < limit:
            following: list[_Node] = []
            for node in level:
                for token in _allowed(node.matcher, len(token_bytes), ends, budget):
                    piece = token_bytes[token]
                    text = node.text + piece
                    if text in seen or (node.keys is not None and node.keys.would_repeat(piece)):
                        continue
                    seen.add(text)
                    budget.spend(_CHILD_COST)
                    child = node.matcher.deep_copy()
                    if not child.consume_token(token):
                        continue
                    if child.is_accepting():
                        return Fewest([*node.tokens, token], depth + 1)
                    if child.is_error() or child.is_stopped():
                        continue
                    child_keys = None
                    if node.keys is not None:
                        child_keys = node.keys.copy()
                        child_keys.feed(piece)
                    following.append(_Node(child, child_keys, [*node.tokens, token], text))
            level = following
            depth += 1
    except OverBudget:
        pass
    return Fewest(None, depth + 1)


class _Node(NamedTuple):
    matcher: LLMatcher
    keys: JsonKeys | None
    tokens: list[int]
    text: bytes


def _allowed(state: LLMatcher, vocab_size: int, ends: frozenset[int], budget: WalkBudget) -> list[int]:
    """The tokens the grammar takes next, end of sequence left out."""
    budget.spend(MASK_COST)
    bits = np.unpackbits(np.frombuffer(state.compute_bitmask(), np.uint8), bitorder="little")
    tokens: list[int] = np.flatnonzero(bits[:vocab_size]).tolist()
    return [token for token in tokens if token not in ends]
