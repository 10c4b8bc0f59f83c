"""Per-key caps on what holds a Redis connection while it waits: event streams, long-polls, OpenAI calls."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from common.apikeys import ANONYMOUS
from common.error_codes import ErrorCode
from gateway.errors import ApiError


class StreamSlots:
    """How many waiting requests each key has open on this gateway, and the cap on them; `refused` is
    called for each request refused for it."""

    def __init__(self, per_key: int, refused: Callable[[], None]) -> None:
        self.per_key = per_key
        self.refused = refused
        self.open: dict[str, int] = {}

    def take(self, owner: str) -> None:
        """Take a slot for `owner`; 429 when the key holds all of its own. A gateway without API keys
        (everyone is the anonymous principal, on loopback unless allowed otherwise) has no cap."""
        held = self.open.get(owner, 0)
        if owner == ANONYMOUS.name:
            self.open[owner] = held + 1
            return
        if held >= self.per_key:
            self.refused()
            raise ApiError(
                429,
                f"this key has {held} streams, long-polls and waiting calls open on this gateway, its limit; "
                "close one first",
                code=ErrorCode.too_many_streams,
                headers={"Retry-After": "1"},
            )
        self.open[owner] = held + 1

    def give_back(self, owner: str) -> None:
        held = self.open.get(owner, 0) - 1
        if held > 0:
            self.open[owner] = held
        else:
            self.open.pop(owner, None)

    @contextlib.contextmanager
    def slot(self, owner: str) -> Iterator[None]:
        self.take(owner)
        try:
            yield
        finally:
            self.give_back(owner)
