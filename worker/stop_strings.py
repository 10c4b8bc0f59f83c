from __future__ import annotations


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still begin one.

    Most pieces cannot take part in a match, and those cost a set test and a dict look-up: a stop
    string can end in a piece only if the piece holds its last character (the held-back text holds no
    whole stop, or it would have ended the text), and text can be held back only if it ends with a
    proper prefix of a stop, found by the text's last character."""

    def __init__(self, stops: list[str], *, keep_stop: bool = False) -> None:
        self._stops = stops
        self._keep_stop = keep_stop
        self._pending = ""
        # Without an empty stop (which matches anywhere), the characters a stop string can end with.
        self._last_chars: frozenset[str] | None = frozenset(s[-1] for s in stops) if all(stops) else None
        # Every stop's proper prefixes by their last character, longest first.
        prefixes: dict[str, list[str]] = {}
        for stop in stops:
            for size in range(1, len(stop)):
                prefixes.setdefault(stop[size - 1], []).append(stop[:size])
        self._prefixes = {
            char: tuple(sorted(set(found), key=len, reverse=True)) for char, found in prefixes.items()
        }

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text now safe to emit, and whether a stop string ended the text (emitted only with keep_stop)."""
        last_chars = self._last_chars
        if last_chars is not None and last_chars.isdisjoint(piece):  # no stop ends in this piece
            if piece and piece[-1] not in self._prefixes:  # nothing to hold back: the common case
                if self._pending:
                    text, self._pending = self._pending + piece, ""
                    return text, False
                return piece, False
            text = self._pending + piece
        else:
            text = self._pending + piece
            hits = [(i, len(stop)) for stop in self._stops if (i := text.find(stop)) >= 0]
            if hits:
                self._pending = ""
                start, size = min(hits)
                return text[: start + size if self._keep_stop else start], True
        keep = self._held_back(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _held_back(self, text: str) -> int:
        """The length of the longest proper prefix of a stop string that ends the text."""
        if not text:
            return 0
        for prefix in self._prefixes.get(text[-1], ()):
            if text.endswith(prefix):
                return len(prefix)
        return 0
