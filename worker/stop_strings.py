from __future__ import annotations


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still begin one."""

    def __init__(self, stops: list[str], *, keep_stop: bool = False) -> None:
        self._stops = stops
        self._keep_stop = keep_stop
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text now safe to emit, and whether a stop string ended the text (emitted only with keep_stop)."""
        text = self._pending + piece
        hits = [(i, len(stop)) for stop in self._stops if (i := text.find(stop)) >= 0]
        if hits:
            self._pending = ""
            start, size = min(hits)
            return text[: start + size if self._keep_stop else start], True
        keep = max((self._overlap(text, stop) for stop in self._stops), default=0)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        for size in range(min(len(text), len(stop) - 1), 0, -1):
            if stop.startswith(text[-size:]):
                return size
        return 0
