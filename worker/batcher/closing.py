"""Structured output that closes within max_tokens: at each step, the shortest way found to end the row's
document from where its grammar stands, and the model's pick overruled only when, after it, no such ending
would fit the tokens left.

`closing_tokens` walks a copy of the row's llguidance matcher byte by byte to an accepting state: the
bytes the grammar forces, else the first byte it allows from a list ordered to end soon (inside a
string: the closing quote; outside: `}`, `]`, `,`, then the shortest values, `""`, `0`, `[]`, `{}`,
`true`, `null`, `false`). A missing required property gets its key from the grammar and a minimal value;
an enum its first allowed value; a `minItems` array that many minimal items. The bytes are then
tokenized as the model's tokenizer would write them (or one token a byte, where that tokenization is
not one the grammar takes), so the ending is a list of tokens the matcher accepts, and its length is
what the ending costs.

`DocumentCloser.steer` keeps the model's pick when the ending after it fits the tokens left after it,
else takes the next token of the ending from the current state (end of sequence once the document is
complete). The ending of the current state always fits: the row starts with one that fits its budget
(else the request fails before it runs), and every step keeps one that fits. A model that ends within
its budget on its own is never overruled, so its tokens are those it writes without the closer.
"""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer

_WALK_LIMIT = 4096  # bytes the walk may write before it gives up (a grammar it cannot end)
_QUOTE = ord('"')
_BACKSLASH = ord("\\")

_ALL = bytes(range(256))


def _order(first: bytes) -> bytes:
    """`first`, then every other byte."""
    return bytes(dict.fromkeys(first + _ALL))


_IN_STRING = _order(b'"abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ')
_ESCAPED = _order(b"n")
_OUTSIDE = _order(b'}],"0[{tnf-123456789.')
_DIGITS = frozenset(b"0123456789")


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


def closing_bytes(matcher: LLMatcher, lexer: Lexer, byte_tokens: ByteTokens) -> bytes | None:
    """The bytes that end the document from the matcher's state (which is left as it was); None when the
    walk finds no ending."""
    walker = matcher.deep_copy()
    lexer = lexer.copy()
    written = bytearray()
    while not walker.is_accepting():
        if len(written) >= _WALK_LIMIT or walker.is_error() or walker.is_stopped():
            return None
        forced = walker.compute_ff_bytes()
        if forced:
            for byte in forced:
                token = byte_tokens.of.get(byte)
                if token is None or not walker.consume_token(token):
                    return None
                lexer.feed_byte(byte)
            written += forced
            continue
        chosen = _next_byte(walker, lexer, byte_tokens)
        if chosen is None:
            return None
        lexer.feed_byte(chosen)
        written.append(chosen)
    return bytes(written)


def _next_byte(walker: LLMatcher, lexer: Lexer, byte_tokens: ByteTokens) -> int | None:
    """Consumes the first candidate byte the grammar allows; for a digit, the first digit after which the
    number may end (`5` where the minimum is 5, not `1` and `0`). None: the grammar allows none."""
    first = None
    for byte in lexer.candidates():
        token = byte_tokens.of.get(byte)
        if token is None or walker.validate_tokens([token]) != 1:
            continue
        if first is None:
            first = byte
            if byte not in _DIGITS or lexer.in_string:
                break
        if byte in _DIGITS and _ends_after(walker, token, byte_tokens):
            first = byte
            break
    if first is not None:
        walker.consume_token(byte_tokens.of[first])
    return first


def _ends_after(walker: LLMatcher, token: int, byte_tokens: ByteTokens) -> bool:
    trial = walker.deep_copy()
    trial.consume_token(token)
    if trial.is_accepting():
        return True
    closers = [byte_tokens.of[b] for b in b'}],"' if b in byte_tokens.of]
    return any(trial.validate_tokens([closer]) == 1 for closer in closers)


def closing_tokens(matcher: LLMatcher, lexer: Lexer, byte_tokens: ByteTokens) -> list[int] | None:
    """The tokens that end the document from the matcher's state: the walk's bytes as the tokenizer
    writes them, if the grammar takes those tokens, else one token a byte."""
    ending = closing_bytes(matcher, lexer, byte_tokens)
    if ending is None:
        return None
    if not ending:
        return []
    tokenizer = byte_tokens.tokenizer
    tokens: list[int] = tokenizer.tokenize_bytes(ending)
    if tokenizer.decode_bytes(tokens) == ending and matcher.validate_tokens(tokens) == len(tokens):
        return tokens
    return [byte_tokens.of[byte] for byte in ending]


class DocumentCloser:
    """Steers one row's picks so that its document ends within the tokens left (module docstring)."""

    def __init__(self, matcher: LLMatcher, byte_tokens: ByteTokens, end_tokens: frozenset[int]) -> None:
        self._matcher = matcher
        self._bytes = byte_tokens
        self._ends = end_tokens
        self._end = min(end_tokens)
        self._lexer = Lexer()
        self._ending: list[int] | None = None  # the current state's ending, once known
        self._after: tuple[int, list[int] | None] | None = None  # the pick `steer` kept and its ending
        self.acted = False  # a pick was overruled: the document was closed early

    def ending(self) -> list[int] | None:
        """The tokens that end the document from the current state (None: no ending was found)."""
        if self._ending is None:
            self._ending = closing_tokens(self._matcher, self._lexer, self._bytes)
        return self._ending

    def steer(self, token: int, left: int) -> int:
        """The token to go on with: the model's `token`, unless the document could then not end within
        the `left` tokens (this one included) that the row may still generate."""
        self._after = None
        if token in self._ends:  # the grammar allows it only where the document is complete
            return token
        after = self._ending_after(token)
        if after is not None and len(after) <= left - 1:
            self._after = (token, after)
            return token
        ending = self.ending()
        if ending is None or len(ending) > left:  # no ending known, or none fits: the model goes on
            return token
        self.acted = True
        if not ending:
            return self._end
        self._after = (ending[0], ending[1:])
        return ending[0]

    def accept(self, token: int, piece: bytes) -> None:
        """The row went on with `token` (whose bytes are `piece`): the matcher has consumed it."""
        after, self._after = self._after, None
        self._ending = after[1] if after is not None and after[0] == token else None
        self._lexer.feed(piece)

    def _ending_after(self, token: int) -> list[int] | None:
        trial = self._matcher.deep_copy()
        if not trial.consume_token(token):
            return None
        lexer = self._lexer.copy()
        lexer.feed(self._bytes.tokenizer.decode_bytes([token]))
        return closing_tokens(trial, lexer, self._bytes)
