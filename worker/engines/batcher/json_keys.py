"""The keys of the JSON objects a row is writing, so that no object gets the same key twice.

A JSON schema grammar lets an object with `additionalProperties` (and every object of `json_object`)
take any key, the same one again included; a weak model then writes one key over and over until
max_tokens. `JsonKeys` reads the row's output byte by byte, as far as it needs to: which object it is in,
whether a string is a key, the keys each open object already has. The sampler asks it whether a token
would end a key that its object already has, and passes over that token.

Keys are compared as written, escapes included (`"a"` and `"\\u0061"` count as two keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_QUOTE = ord('"')
_BACKSLASH = ord("\\")


@dataclass
class _Object:
    keys: set[bytes] = field(default_factory=set)
    expects_key: bool = True


@dataclass
class JsonKeys:
    _open: list[_Object | None] = field(default_factory=list)  # None: an array
    _in_string: bool = False
    _escaped: bool = False
    _key: bytearray | None = None  # the key being written, None in a value string or outside strings

    def feed(self, text: bytes) -> None:
        """Read the row's next bytes."""
        self._read(text, check=False)

    def would_repeat(self, text: bytes) -> bool:
        """Whether these bytes, next, would end a key that their object already has."""
        if _QUOTE not in text:  # a key ends only at a quote
            return False
        return self.copy()._read(text, check=True)

    def copy(self) -> JsonKeys:
        return JsonKeys(
            [None if o is None else _Object(set(o.keys), o.expects_key) for o in self._open],
            self._in_string,
            self._escaped,
            None if self._key is None else bytearray(self._key),
        )

    def _read(self, text: bytes, *, check: bool) -> bool:
        for byte in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == _BACKSLASH:
                    self._escaped = True
                elif byte == _QUOTE:
                    self._in_string = False
                    if self._key is not None and self._end_key(bytes(self._key)) and check:
                        return True
                    self._key = None
                    continue
                if self._key is not None:
                    self._key.append(byte)
                continue
            top = self._open[-1] if self._open else None
            if byte == _QUOTE:
                self._in_string = True
                self._key = bytearray() if top is not None and top.expects_key else None
            elif byte == ord("{"):
                self._open.append(_Object())
            elif byte == ord("["):
                self._open.append(None)
            elif byte in b"}]":
                if self._open:
                    self._open.pop()
            elif byte == ord(":") and top is not None:
                top.expects_key = False
            elif byte == ord(",") and top is not None:
                top.expects_key = True
        return False

    def _end_key(self, key: bytes) -> bool:
        """Record a finished key; True if its object had it already."""
        top = self._open[-1]
        assert top is not None
        repeated = key in top.keys
        top.keys.add(key)
        return repeated
