"""Structured output that closes within max_tokens: at each step, a short way found to end the row's
document from where its grammar stands, and the model's pick overruled only when, after it, no such ending
would fit the tokens left.

`DocumentCloser.steer` keeps the model's pick when an ending after it fits the tokens left after it, else
takes the next token of the ending from the current state (end of sequence once the document is
complete). The ending of the current state always fits: the row starts with one that fits its budget
(else the request fails before it runs), and every step keeps one that fits. A model that ends within
its budget on its own is never overruled, so its tokens are those it writes without the closer.

The ending after a pick is found, cheapest first: the current ending's rest where the pick is its next
token; the current ending less the bytes the pick wrote, or the whole of it, where the grammar takes that
after the pick (a string the model goes on writing, a pattern it fills); else a walk
(closing_walk.py). What one step of a row may spend on it is bounded (`STEP_BUDGET`), as is the first
ending (`START_BUDGET`): a pick whose ending costs more is overruled as one that does not fit, and a
grammar whose first ending costs more is not closed at all. One row's grammar thus never holds the step
of the others for long. The first ending is looked for once per grammar, off the engine's thread, and
handed to each row's closer (grammar_starts.py).
"""

from __future__ import annotations

from typing import NamedTuple

from llguidance import LLMatcher

from worker.engines.batcher.closing_walk import (
    ByteTokens,
    Lexer,
    WalkBudget,
    closing_bytes,
    written_as_tokens,
)
from worker.engines.batcher.json_keys import JsonKeys

START_BUDGET = 40_000  # matcher work a row's first ending may cost (tens of ms on one core)
STEP_BUDGET = 3_000  # matcher work one step of a row may spend on the ending after the model's pick


class Ending(NamedTuple):
    """Tokens that end the document, and their bytes."""

    tokens: list[int]
    text: bytes


def first_ending(matcher: LLMatcher, byte_tokens: ByteTokens, json: bool) -> Ending | None:
    """The walk's ending from the matcher's state (left as it was), found within `START_BUDGET`; None
    when it finds none."""
    keys = JsonKeys() if json else None
    return _walk(matcher, Lexer(), byte_tokens, keys, WalkBudget(START_BUDGET))


def _walk(
    matcher: LLMatcher, lexer: Lexer, byte_tokens: ByteTokens, keys: JsonKeys | None, budget: WalkBudget
) -> Ending | None:
    """The walk's ending from the matcher's state (left as it was), in tokens the matcher takes."""
    text = closing_bytes(matcher, lexer, byte_tokens, keys, budget)
    return None if text is None else Ending(written_as_tokens(matcher, text, byte_tokens), text)


class DocumentCloser:
    """Steers one row's picks so that its document ends within the tokens left (module docstring)."""

    def __init__(
        self,
        matcher: LLMatcher,
        byte_tokens: ByteTokens,
        end_tokens: frozenset[int],
        json: bool = False,
        first: Ending | None = None,
    ) -> None:
        self._matcher = matcher
        self._bytes = byte_tokens
        self._decode = byte_tokens.tokenizer.decode_bytes
        self._ends = end_tokens
        self._end = min(end_tokens)
        self._lexer = Lexer()
        self._keys = JsonKeys() if json else None  # the keys each open object has (JSON only)
        self._ending = first  # the current state's ending, once known
        self._started = first is not None  # the first ending was looked for (or given: grammar_starts.py)
        self._after: tuple[int, Ending] | None = None  # the pick `steer` kept and its ending
        self.acted = False  # a pick was overruled: the document was closed early

    def ending(self) -> list[int] | None:
        """The tokens that end the document from the current state (None: no ending was found)."""
        if self._ending is None:
            budget = STEP_BUDGET if self._started else START_BUDGET
            self._started = True
            self._ending = _walk(self._matcher, self._lexer, self._bytes, self._keys, WalkBudget(budget))
        return None if self._ending is None else self._ending.tokens

    def steer(self, token: int, left: int) -> int:
        """The token to go on with: the model's `token`, unless the document could then not end within
        the `left` tokens (this one included) that the row may still generate."""
        self._after = None
        if token in self._ends:  # the grammar allows it only where the document is complete
            return token
        after = self._ending_after(token, left - 1)
        if after is not None:
            self._after = (token, after)
            return token
        tokens = self.ending()
        if tokens is None or len(tokens) > left:  # no ending known, or none fits: the model goes on
            return token
        self.acted = True
        if not tokens:
            return self._end
        assert self._ending is not None
        self._after = (tokens[0], self._rest(self._ending))
        return tokens[0]

    def accept(self, token: int, piece: bytes) -> None:
        """The row went on with `token` (whose bytes are `piece`): the matcher has consumed it."""
        after, self._after = self._after, None
        self._ending = after[1] if after is not None and after[0] == token else None
        self._lexer.feed(piece)
        if self._keys is not None:
            self._keys.feed(piece)

    def _ending_after(self, token: int, room: int) -> Ending | None:
        """An ending of at most `room` tokens after `token`, if one is found within `STEP_BUDGET`."""
        current = self._ending
        if current is not None and current.tokens and current.tokens[0] == token:
            return self._rest(current) if len(current.tokens) - 1 <= room else None
        trial = self._matcher.deep_copy()
        if not trial.consume_token(token):
            return None
        piece = self._decode([token])
        lexer = self._lexer.copy()
        lexer.feed(piece)
        keys = None
        if self._keys is not None:
            keys = self._keys.copy()
            keys.feed(piece)
        spent = 0  # on trying the current ending
        if current is not None:
            for reused in (self._less(current, len(piece)), current):
                if reused is not None and len(reused.tokens) <= room and self._completes(trial, keys, reused):
                    return reused
            spent = 2 * len(current.tokens)
        budget = WalkBudget(STEP_BUDGET - spent)
        walked = _walk(trial, lexer, self._bytes, keys, budget)
        return walked if walked is not None and len(walked.tokens) <= room else None

    def _completes(self, matcher: LLMatcher, keys: JsonKeys | None, ending: Ending) -> bool:
        """The grammar takes the ending from the matcher's state and is then complete, with no key twice."""
        if keys is not None and keys.would_repeat(ending.text):
            return False
        if not ending.tokens:
            return bool(matcher.is_accepting())
        return bool(matcher.validate_tokens([*ending.tokens, self._end]) == len(ending.tokens) + 1)

    def _rest(self, ending: Ending) -> Ending:
        """The ending after its first token."""
        return Ending(ending.tokens[1:], ending.text[len(self._decode(ending.tokens[:1])) :])

    def _less(self, ending: Ending, count: int) -> Ending | None:
        """The ending without its first `count` bytes (None: it has no more), in its own tokens from the
        first whole one on."""
        if count > len(ending.text):
            return None
        taken = 0
        for index, token in enumerate(ending.tokens):
            if taken >= count:
                head = self._byte_tokens(ending.text[count:taken])
                return None if head is None else Ending(head + ending.tokens[index:], ending.text[count:])
            taken += len(self._decode([token]))
        head = self._byte_tokens(ending.text[count:])
        return None if head is None else Ending(head, ending.text[count:])

    def _byte_tokens(self, text: bytes) -> list[int] | None:
        """`text` one token a byte (None: a byte has no token of its own)."""
        of = self._bytes.of
        return None if any(byte not in of for byte in text) else [of[byte] for byte in text]
