"""What a key owns (its files, its batches): named by the id in a route's path and found only by its
owner; another key's object answers the same 404 as one that never existed. Listed a page at a time."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import JSONResponse

from common.error_codes import ErrorCode
from gateway.auth import principal_of
from gateway.errors import ApiError


class Owned(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def owner(self) -> str: ...

    def view(self) -> dict[str, Any]: ...


OwnedT = TypeVar("OwnedT", bound=Owned)


@dataclass(frozen=True)
class OwnedKind:
    noun: str  # how messages name it: "file"
    param: str  # the path parameter that holds its id
    code: ErrorCode  # the code of its 404
    prefix: str  # how its ids begin: "file-"

    def not_found(self, object_id: str) -> ApiError:
        return ApiError(
            404,
            f"{self.noun} {object_id!r} does not exist (or has expired)",
            param=self.param,
            code=self.code,
        )

    async def from_path(
        self, request: Request, load: Callable[[str, str], Awaitable[OwnedT | None]]
    ) -> OwnedT:
        """The object the path names, when the caller's key owns it; `load` takes its id and the owner."""
        object_id = request.path_params[self.param]
        owner = principal_of(request.scope).name
        found = await load(object_id, owner)
        if found is None or found.owner != owner:
            raise self.not_found(object_id)
        return found

    def page_after(self, request: Request) -> str | None:
        """The list's `after` cursor: an id of this kind (it need not exist), else 400 naming it."""
        after = request.query_params.get("after")
        if after is not None and not re.fullmatch(re.escape(self.prefix) + _ID_CHARS, after, re.ASCII):
            raise ApiError(400, f"after: {after[:100]!r} is not the id of a {self.noun}", param="after")
        return after


_ID_CHARS = "[A-Za-z0-9_-]{1,64}"


async def newest_after(redis: Redis, index: str, after: str | None, start: int, count: int) -> list[str]:
    """Up to `count` ids of the sorted set `index`, newest (highest score) first, skipping `start` of
    those after the id `after` (none when `after` is not in it). Ids of one score come in descending
    order of id, as ZREVRANGEBYSCORE gives them, so a page ends and the next begins among them."""
    upper, skip = "+inf", 0
    if after is not None:
        score = await redis.zscore(index, after)
        if score is None:
            return []
        upper = repr(score)
        tied: list[str] = await redis.zrevrangebyscore(index, upper, upper)
        skip = tied.index(after) + 1
    ids: list[str] = await redis.zrevrangebyscore(index, upper, "-inf", start=skip + start, num=count)
    return ids


def page_limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit", str(default))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= most:  # not "²"
        raise ApiError(400, f"limit: must be a whole number from 1 to {most}", param="limit")
    return int(raw)


def list_page(found: Sequence[Owned], limit: int) -> JSONResponse:
    """OpenAI's list of the first `limit` of `found`, which holds one more when there are more."""
    page = found[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": [owned.view() for owned in page],
            "has_more": len(found) > limit,
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
        }
    )
