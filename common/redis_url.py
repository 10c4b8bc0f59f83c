"""Redis URLs: plain ones (redis://, rediss://, unix://) and Sentinel ones (redis+sentinel://)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
URL_FORMAT = "redis://[user][:password@]host:port/db"
SENTINEL_FORMAT = (
    "redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/DB][?sentinel_password=...]"
)
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_SECRET_OPTIONS = ("password", "sentinel_password")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:]+)(?::([0-9]{1,5}))?")


class BadRedisUrl(ValueError):
    """A Redis URL ortfleet cannot use; the message names what is wrong."""


@dataclass(frozen=True)
class SentinelUrl:
    """What a redis+sentinel:// URL says: where the sentinels are and which primary to ask them for."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None  # of the primary (and its replicas)
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a Sentinel URL; BadRedisUrl naming the problem when it is malformed."""
    if not is_sentinel_url(url):
        raise BadRedisUrl(f"not a Sentinel URL (expected {SENTINEL_FORMAT})")
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise BadRedisUrl("a Sentinel URL takes no #fragment")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_sentinel_address(part) for part in hosts.split(","))
    segments = path.split("/") if path else []
    if not segments or not segments[0]:
        raise BadRedisUrl(
            f"the Sentinel URL names no service (the primary's name): expected {SENTINEL_FORMAT}"
        )
    if len(segments) > 2:
        raise BadRedisUrl("the Sentinel URL's path has too many parts: expected /SERVICE or /SERVICE/DB")
    db = 0
    if len(segments) == 2 and segments[1]:
        if not (segments[1].isascii() and segments[1].isdigit()):
            raise BadRedisUrl(f"the Sentinel URL's database {segments[1]!r} is not a number")
        db = int(segments[1])
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_SENTINEL_OPTIONS))
    if unknown:
        raise BadRedisUrl(
            f"the Sentinel URL has unknown option(s) {', '.join(unknown)}; "
            f"known: {', '.join(_SENTINEL_OPTIONS)}"
        )
    return SentinelUrl(
        sentinels=sentinels,
        service=unquote(segments[0]),
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def _sentinel_address(part: str) -> tuple[str, int]:
    if not part:
        raise BadRedisUrl(f"the Sentinel URL has an empty sentinel address: expected {SENTINEL_FORMAT}")
    match = _HOST_PORT.fullmatch(part)
    if match is None:
        raise BadRedisUrl(f"the Sentinel URL's address {part!r} is not host:port")
    host, port = match.group(1).strip("[]"), int(match.group(2) or SENTINEL_PORT)
    if not 0 < port < 65536:
        raise BadRedisUrl(f"the Sentinel URL's address {part!r} has port {port}, outside 1-65535")
    return host, port


def check_redis_url(url: str) -> None:
    """BadRedisUrl, naming the problem, for a URL no Redis client could be made from."""
    if is_sentinel_url(url):
        parse_sentinel_url(url)
        return
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise BadRedisUrl(
            f"the Redis URL's scheme {scheme or '(none)'!r} is not one of redis://, rediss://, unix:// "
            f"or {SENTINEL_SCHEME}://"
        )


def mask_url(url: str) -> str:
    """The URL with its passwords replaced by stars, fit for logs and `ortfleet config`."""
    if is_sentinel_url(url):
        return _mask_sentinel_url(url)
    parts = urlsplit(url)
    query = _mask_query(parts.query)
    if not parts.password:
        return url if query == parts.query else urlunsplit((*parts[:3], query, parts.fragment))
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:****@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _mask_sentinel_url(url: str) -> str:
    """Masks without parsing fully, so that even a malformed Sentinel URL is safe to show."""
    head = url[: len(SENTINEL_SCHEME) + 3]
    rest, question, query = url[len(head) :].partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":****"
    masked = f"{head}{userinfo}{at}{hosts}{slash}{path}"
    return f"{masked}{question}{_mask_query(query)}" if question else masked


def _mask_query(query: str) -> str:
    if not any(name in query for name in _SECRET_OPTIONS):
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    return urlencode([(k, "****" if k in _SECRET_OPTIONS else v) for k, v in pairs], safe="*")
