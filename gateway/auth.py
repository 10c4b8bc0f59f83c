"""API-key authentication and per-key request rates, as a plain ASGI middleware."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from common import lua
from common.apikeys import ANONYMOUS, KeyRing, Principal
from common.error_codes import ErrorCode
from common.keys import Keyspace
from gateway.errors import envelope

logger = logging.getLogger(__name__)

STREAM_TOKEN_INVALID = "\n"  # no key is named so
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/health", "/version"})
METRICS_PATH = "/metrics"
FLEET_PATH = "/v1/fleet"  # also open to the metrics key, which sees the fleet's load there
CONSOLE_PREFIX = "/console/"  # the console's page and assets hold no data: the page asks for a key
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # the operators' routes


def principal_of(scope: Scope) -> Principal:
    principal = scope.get("state", {}).get("principal", ANONYMOUS)
    assert isinstance(principal, Principal)
    return principal


class ApiKeyAuth:
    """Every route but the health checks and /version needs `Authorization: Bearer KEY` once keys are
    configured; /metrics needs its own key when one is set, and the operators' routes (ADMIN_PATHS) the
    admin key once it is set or keys are. The caller's key becomes the request's principal."""

    def __init__(
        self,
        app: ASGIApp,
        keyring: KeyRing,
        metrics_key: str | None,
        default_requests_per_minute: int,
        default_max_concurrent_jobs: int,
        default_max_prompt_tokens_in_flight: int = 0,
        default_tokenize_chars_per_s: int = 0,
        stream_token_key: Callable[[Scope], str | None] | None = None,
        admin_key: str | None = None,
    ) -> None:
        """`stream_token_key`: the key name a request's stream token vouches for, STREAM_TOKEN_INVALID for
        a bad token, None when it has none."""
        self.app = app
        self.stream_token_key = stream_token_key
        self.keyring = keyring
        self.metrics_key = metrics_key
        self.admin_key = admin_key
        self.defaults = Principal(  # the limits of a key that sets none of its own
            "",
            default_max_concurrent_jobs,
            default_requests_per_minute,
            max_prompt_tokens_in_flight=default_max_prompt_tokens_in_flight or None,
            tokenize_chars_per_s=default_tokenize_chars_per_s or None,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or _is_console(scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = _bearer(scope)
        if scope["path"] == FLEET_PATH and self.metrics_key and _same(presented, self.metrics_key):
            await self.app(scope, receive, send)  # as the anonymous principal: no owner, every figure
            return
        if scope["path"] == METRICS_PATH:
            if self.metrics_key is not None and not _same(presented, self.metrics_key):
                await _reject(send, 401, "a valid metrics key is required: Authorization: Bearer KEY")
                return
            await self.app(scope, receive, send)
            return
        if scope["path"] in ADMIN_PATHS and (self.keyring.enabled or self.admin_key is not None):
            await self._admin(scope, receive, send, presented)
            return
        if not self.keyring.enabled:
            await self.app(scope, receive, send)
            return
        if (
            presented is None
            and self.stream_token_key is not None
            and (token := self.stream_token_key(scope))
        ):
            key = self.keyring.named(token)
            if key is None:
                message = "the stream token is not valid for this job (expired, altered, or its key revoked)"
                await _reject(send, 401, message)
                return
        elif presented is None:
            await _reject(send, 401, "an API key is required: send Authorization: Bearer KEY")
            return
        else:
            key = self.keyring.authenticate(presented)
        if key is None:
            await _reject(send, 401, "the API key is not valid (unknown or revoked)")
            return
        defaults = self.defaults
        principal = Principal(
            key.name,
            key.max_concurrent_jobs or defaults.max_concurrent_jobs,
            key.requests_per_minute or defaults.requests_per_minute,
            key.weight,
            key.max_class,
            defaults.max_prompt_tokens_in_flight,
            defaults.tokenize_chars_per_s,
        )
        retry_after = await self._over_rate(scope, principal)
        if retry_after:
            message = (
                f"key {key.name!r} is over its limit of {principal.requests_per_minute} requests per minute"
            )
            limited = ErrorCode.rate_limit_exceeded
            await _reject(send, 429, message, {"Retry-After": str(retry_after)}, code=limited)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    async def _admin(self, scope: Scope, receive: Receive, send: Send, presented: str | None) -> None:
        """An operator's route: the admin key passes (as the anonymous principal); a client's key gets 403."""
        if self.admin_key is not None and _same(presented, self.admin_key):
            await self.app(scope, receive, send)
            return
        if presented is None:
            await _reject(send, 401, "the admin key is required: send Authorization: Bearer KEY")
            return
        key = self.keyring.authenticate(presented) if self.keyring.enabled else None
        if key is None:
            await _reject(send, 401, "the API key is not valid (unknown or revoked)")
            return
        why = "is not it" if self.admin_key is not None else "is a client's, and no admin key is set"
        message = (
            f"{scope['path']} is an operator's route: it needs the admin key (ORTFLEET_ADMIN_API_KEY), and "
            f"key {key.name!r} {why}"
        )
        await _reject(send, 403, message, code=ErrorCode.admin_key_required)

    async def _over_rate(self, scope: Scope, principal: Principal) -> int:
        """Seconds until the key may call again (0: it may now), counted in Redis across all gateways."""
        limit = principal.requests_per_minute
        if not limit:
            return 0
        now_ms = int(time.time() * 1000)
        state = scope["app"].state.ortfleet
        member = f"{now_ms}-{secrets.token_hex(4)}"
        try:
            return await request_rate_wait(
                state.redis,
                state.keys,
                key_name=principal.name,
                now_ms=now_ms,
                per_minute=limit,
                member=member,
            )
        except RedisError as e:
            logger.warning("request rate of %s not counted: %s", principal.name, e)
            return 0


async def request_rate_wait(
    redis: Redis, keys: Keyspace, *, key_name: str, now_ms: int, per_minute: int, member: str
) -> int:
    """scripts/request_rate.lua: counts the request in the key's sliding minute and answers 0, or, the key
    being at its limit, counts nothing and answers the seconds until it may call again."""
    script = lua.register(redis, __name__, "request_rate.lua")
    wait = await script(keys=[keys.request_rate(key_name)], args=[now_ms, per_minute, member])
    return int(wait)


def _is_console(path: str) -> bool:
    return path == "/" or path.startswith(CONSOLE_PREFIX)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            header: str = value.decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _same(presented: str | None, expected: str) -> bool:
    return presented is not None and bool(secrets.compare_digest(presented.encode(), expected.encode()))


async def _reject(
    send: Send,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    code: ErrorCode | None = None,
) -> None:
    code = code or (ErrorCode.invalid_api_key if status == 401 else None)
    body = json.dumps(envelope(status, message, code=code))
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        raw_headers.append((b"www-authenticate", b'Bearer realm="ortfleet"'))
    for name, value in (headers or {}).items():
        raw_headers.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body.encode()})
