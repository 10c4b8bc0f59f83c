"""The walk that finds a short ending of a structured document from where its grammar stands.

`closing_bytes` walks a copy of the row's llguidance matcher byte by byte to an accepting state: the
bytes the grammar forces, else the first byte it allows from a list ordered to end soon (inside a
string: the closing quote; outside: `}`, `]`, `,`, then the shortest values, `""`, `0`, `[]`, `{}`,
`true`, `null`, `false`). A missing required property gets its key from the grammar and a minimal value;
an enum its first allowed value; a `minItems` array that many minimal items; an object that must hold
more properties gets keys it has not yet (`JsonKeys`).

Where that order goes round in a loop (an e-mail address, whose local part takes letters for ever; a
list whose separator always comes before its end), a breadth-first search takes over once the walk has
chosen 8 bytes in a row without going in or out of a string (again after 16 more, 32, ...): the fewest
bytes to an accepting state, states that allow the same bytes counted as one.

Every walk is paid from a `WalkBudget` of matcher work (a single-token check is one unit, a whole
mask `MASK_COST`), so that no grammar, however costly its ending, holds an engine step for long: a walk
that runs out has found no ending.

The bytes are then tokenized as the model's tokenizer would write them (or one token a byte, where that
tokenization is not one the grammar takes), so the ending is a list of tokens the matcher accepts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from worker.engines.batcher.json_keys import JsonKeys

WALK_LIMIT = 4096  # bytes a walk may write before it gives up (a grammar it cannot end)
MASK_COST = 25  # a mask over the vocabulary costs about as much as 25 single-token checks
_CHECKS_BEFORE_MASK = 8  # candidate bytes checked one by one before the whole mask is computed
_SEARCH_EVERY = 8  # bytes chosen in a row, in a string or out of one, before the first search
_SEARCH_UNITS = 5000  # the most one search may spend
_QUOTE = ord('"')
_BACKSLASH = ord("\\")

_ALL = bytes(range(256))


def _order(first: bytes) -> bytes:
    """`first`, then every other byte."""
    return bytes(dict.fromkeys(first + _ALL))


_IN_STRING = _order(b'"abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ')
_ESCAPED = _order(b"n")
_OUTSIDE = _order(b'}],"0[{tnf-123456789.')
_ORDER_ARRAYS = {order: np.frombuffer(order, np.uint8) for order in (_IN_STRING, _ESCAPED, _OUTSIDE)}
_DIGITS = frozenset(b"0123456789")
# bytes a search tries only the first allowed one of: they lead to alike states
_CLASSES = [
    frozenset(range(a, b + 1)) for a, b in ((97, 122), (65, 90), (48, 57), (0x80, 0xBF), (0xC0, 0xFF))
]
_CLASS_OF = {byte: index for index, members in enumerate(_CLASSES) for byte in members}


class OverBudget(Exception):
    """A walk spent its budget before it found an ending."""


class WalkBudget:
    """Matcher work a walk may still do, in single-token checks (a mask counts `MASK_COST`)."""

    __slots__ = ("left",)

    def __init__(self, units: int) -> None:
        self.left = units

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise OverBudget


class Lexer:
    """Whether the bytes so far leave the text inside a JSON string (and just after a backslash)."""

    __slots__ = ("escaped", "in_string")

    def __init__(self, in_string: bool = False, escaped: bool = False) -> None:
        self.in_string = in_string
        self.escaped = escaped

    def copy(self) -> Lexer:
        return Lexer(self.in_string, self.escaped)

    def feed(self, text: bytes) -> None:
        for byte in text:
            self.feed_byte(byte)

    def feed_byte(self, byte: int) -> None:
        if self.escaped:
            self.escaped = False
        elif self.in_string and byte == _BACKSLASH:
            self.escaped = True
        elif byte == _QUOTE:
            self.in_string = not self.in_string

    def candidates(self) -> bytes:
        if self.escaped:
            return _ESCAPED
        return _IN_STRING if self.in_string else _OUTSIDE


class ByteTokens:
    """The token of each single byte in the model's vocabulary (byte-level BPE has one for every byte
    that UTF-8 text holds), and the tokenizer that writes the ending."""

    def __init__(self, tokenizer: LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.of: dict[int, int] = {}
        for byte in range(256):
            ids = tokenizer.tokenize_bytes(bytes([byte]))
            if len(ids) == 1 and tokenizer.decode_bytes(ids) == bytes([byte]):
                self.of[byte] = ids[0]
        self._bytes = np.fromiter(self.of, np.int64)
        self._ids = np.fromiter(self.of.values(), np.int64)

    def allowed(self, matcher: LLMatcher) -> np.ndarray:
        """Which of the 256 bytes the matcher takes next, from one mask over the vocabulary."""
        mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        bits = np.zeros(256, np.bool_)
        bits[self._bytes] = (mask[self._ids >> 3] >> (self._ids & 7)) & 1
        return bits


class _Walk:
    """One walk: a copy of the matcher, the lexer and the keys, moved byte by byte."""

    def __init__(
        self,
        matcher: LLMatcher,
        lexer: Lexer,
        keys: JsonKeys | None,
        byte_tokens: ByteTokens,
        budget: WalkBudget,
    ) -> None:
        self.matcher = matcher
        self.lexer = lexer
        self.keys = keys
        self.bytes = byte_tokens
        self.budget = budget

    def copy(self, budget: WalkBudget) -> _Walk:
        self.budget.spend(2)
        keys = None if self.keys is None else self.keys.copy()
        return _Walk(self.matcher.deep_copy(), self.lexer.copy(), keys, self.bytes, budget)

    def take(self, byte: int) -> bool:
        """Consumes one byte; False if the grammar refuses it (or the model has no token for it)."""
        token = self.bytes.of.get(byte)
        self.budget.spend(1)
        if token is None or not self.matcher.consume_token(token):
            return False
        self.lexer.feed_byte(byte)
        if self.keys is not None:
            self.keys.feed(bytes([byte]))
        return True

    def forced(self) -> bytes | None:
        """Takes the bytes the grammar forces from here (b"" if none); None if one is refused."""
        self.budget.spend(2)
        forced = self.matcher.compute_ff_bytes()
        if not all(self.take(byte) for byte in forced):
            return None
        return forced

    def allowed(self) -> np.ndarray:
        self.budget.spend(MASK_COST)
        return self.bytes.allowed(self.matcher)

    def repeats_key(self, byte: int) -> bool:
        """The byte would end a key that its object already has."""
        return byte == _QUOTE and self.keys is not None and self.keys.would_repeat(b'"')

    def run(self) -> bytes | None:
        written = bytearray()
        chosen = 0  # bytes chosen in a row without going in or out of a string
        search_at = _SEARCH_EVERY  # doubled after each search that finds nothing
        matcher = self.matcher
        while not matcher.is_accepting():
            if len(written) >= WALK_LIMIT or matcher.is_error() or matcher.is_stopped():
                return None
            in_string = self.lexer.in_string
            forced = self.forced()
            if forced is None:
                return None
            if forced:
                written += forced
                chosen = chosen if self.lexer.in_string == in_string and _QUOTE not in forced else 0
                continue
            if chosen >= search_at:
                rest = self.search()
                if rest is not None:
                    return bytes(written + rest)
                search_at *= 2
            in_string = self.lexer.in_string
            byte = self.next_byte()
            if byte is None:
                return None
            written.append(byte)
            chosen = chosen + 1 if self.lexer.in_string == in_string else 0
        return bytes(written)

    def next_byte(self) -> int | None:
        """Takes the first candidate byte the grammar allows; for a digit, the first digit after which the
        number may end (`5` where the minimum is 5, not `1` and `0`). None: the grammar allows none."""
        first = None
        for byte in self._allowed_in_order():
            if self.repeats_key(byte):
                continue
            if first is None:
                first = byte
                if byte not in _DIGITS or self.lexer.in_string:
                    break
            if byte in _DIGITS and self._ends_after(byte):
                first = byte
                break
        if first is None or not self.take(first):
            return None
        return first

    def _allowed_in_order(self) -> Iterator[int]:
        """The bytes the grammar allows next, in the lexer's order: the first few checked one by one, the
        rest read from one mask."""
        order = self.lexer.candidates()
        checked = 0
        for position, byte in enumerate(order):
            token = self.bytes.of.get(byte)
            if token is None:
                continue
            if checked == _CHECKS_BEFORE_MASK:
                rest = _ORDER_ARRAYS[order][position:]
                yield from rest[self.allowed()[rest]].tolist()
                return
            checked += 1
            self.budget.spend(1)
            if self.matcher.validate_tokens([token]) == 1:
                yield byte

    def _ends_after(self, byte: int) -> bool:
        trial = self.copy(self.budget)
        trial.take(byte)
        if trial.matcher.is_accepting():
            return True
        closers = [trial.bytes.of[b] for b in b'}],"' if b in trial.bytes.of]
        self.budget.spend(len(closers))
        return any(trial.matcher.validate_tokens([closer]) == 1 for closer in closers)

    def search(self) -> bytes | None:
        """The fewest bytes that end the document from here, found breadth first within `_SEARCH_UNITS`
        (states that allow the same bytes taken for one); None if none was found. The walk is unmoved."""
        budget = WalkBudget(min(_SEARCH_UNITS, self.budget.left))
        spent = budget.left
        try:
            return _search(self.copy(budget))
        except OverBudget:
            return None
        finally:
            self.budget.spend(spent - max(budget.left, 0))


def _search(start: _Walk) -> bytes | None:
    bits = start.allowed()
    seen = {_signature(start, bits)}
    frontier: deque[tuple[_Walk, np.ndarray, bytes]] = deque([(start, bits, b"")])
    while frontier:
        state, bits, path = frontier.popleft()
        for byte in _representatives(bits, state.lexer):
            if state.repeats_key(byte):
                continue
            trial = state.copy(state.budget)
            if not trial.take(byte):
                continue
            forced = trial.forced()
            if forced is None:
                continue
            reached = path + bytes([byte]) + forced
            if trial.matcher.is_accepting():
                return reached
            if trial.matcher.is_error() or trial.matcher.is_stopped():
                continue
            trial_bits = trial.allowed()
            signature = _signature(trial, trial_bits)
            if signature not in seen:
                seen.add(signature)
                frontier.append((trial, trial_bits, reached))
    return None


def _signature(walk: _Walk, bits: np.ndarray) -> tuple[bytes, bool, bool]:
    return np.packbits(bits).tobytes(), walk.lexer.in_string, walk.lexer.escaped


def _representatives(bits: np.ndarray, lexer: Lexer) -> list[int]:
    """The allowed bytes in the lexer's order, only the first of each class of alike bytes."""
    taken: set[int] = set()
    chosen = []
    for byte in lexer.candidates():
        if not bits[byte]:
            continue
        kind = _CLASS_OF.get(byte)
        if kind is not None:
            if kind in taken:
                continue
            taken.add(kind)
        chosen.append(byte)
    return chosen


def closing_bytes(
    matcher: LLMatcher,
    lexer: Lexer,
    byte_tokens: ByteTokens,
    keys: JsonKeys | None = None,
    budget: WalkBudget | None = None,
) -> bytes | None:
    """The bytes that end the document from the matcher's state (which is left as it was); None when the
    walk finds no ending (or spends its budget first)."""
    budget = budget or WalkBudget(1 << 62)
    try:
        walk = _Walk(matcher, lexer, keys, byte_tokens, budget).copy(budget)
        return walk.run()
    except OverBudget:
        return None


def written_as_tokens(matcher: LLMatcher, text: bytes, byte_tokens: ByteTokens) -> list[int]:
    """`text` as the tokenizer writes it, if the grammar takes those tokens, else one token a byte."""
    if not text:
        return []
    tokenizer = byte_tokens.tokenizer
    tokens: list[int] = tokenizer.tokenize_bytes(text)
    if tokenizer.decode_bytes(tokens) == text and matcher.validate_tokens(tokens) == len(tokens):
        return tokens
    return [byte_tokens.of[byte] for byte in text]


def closing_tokens(
    matcher: LLMatcher,
    lexer: Lexer,
    byte_tokens: ByteTokens,
    keys: JsonKeys | None = None,
    budget: WalkBudget | None = None,
) -> list[int] | None:
    """The tokens that end the document from the matcher's state: the walk's bytes as the tokenizer
    writes them, if the grammar takes those tokens, else one token a byte."""
    ending = closing_bytes(matcher, lexer, byte_tokens, keys, budget)
    return None if ending is None else written_as_tokens(matcher, ending, byte_tokens)
