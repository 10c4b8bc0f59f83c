"""Signed stream tokens: how a browser's EventSource, which cannot send an Authorization header, reads
a job's events on a keyed gateway.

The job's owner asks for a token with its key (`POST /v1/jobs/{id}/stream-token`, in gateway/jobs.py)
and puts it in the events URL (`?stream_token=...`). The token is an HMAC-SHA256, under
ORTFLEET_STREAM_TOKEN_SECRET, of the job id, the key's name and an expiry: it opens that one job's
events only, as that key, until it expires; revoking the key revokes its tokens. Every gateway sharing
the secret accepts it, so a stream resumes (Last-Event-ID) on any replica or after a restart. A stream
that is open when its token expires goes on; reconnecting needs a valid token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

from starlette.types import Scope

from gateway.auth import STREAM_TOKEN_INVALID

QUERY_PARAM = "stream_token"
EVENTS_PATH = re.compile(r"^/v1/jobs/(?P<job_id>[^/]+)/events$")
_VERSION = "v1"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StreamTokens:
    def __init__(self, secret: bytes, ttl_s: int) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def _mac(self, job_id: str, key_name: str, expires: int) -> str:
        message = f"{_VERSION}\n{job_id}\n{key_name}\n{expires}".encode()
        return _b64(hmac.new(self._secret, message, hashlib.sha256).digest())

    def issue(self, job_id: str, key_name: str, now: float | None = None) -> tuple[str, int]:
        """The token for `job_id` as `key_name`, and when it expires (Unix seconds)."""
        expires = int(now if now is not None else time.time()) + self.ttl_s
        token = f"{_VERSION}.{_b64(key_name.encode())}.{expires}.{self._mac(job_id, key_name, expires)}"
        return token, expires

    def verify(self, token: str, job_id: str, now: float | None = None) -> str | None:
        """The key name a valid, unexpired token for `job_id` was issued to; None otherwise."""
        try:
            version, name_b64, expires_text, mac = token.split(".")
            key_name = _unb64(name_b64).decode()
            expires = int(expires_text)
        except (ValueError, UnicodeDecodeError):
            return None
        if version != _VERSION or expires < (now if now is not None else time.time()):
            return None
        if not hmac.compare_digest(mac, self._mac(job_id, key_name, expires)):
            return None
        return key_name

    def key_of(self, scope: Scope) -> str | None:
        """For ApiKeyAuth: the key name a request's stream token vouches for; STREAM_TOKEN_INVALID for a
        bad one; None when the request has none."""
        presented = presented_token(scope)
        if presented is None:
            return None
        return self.verify(presented[1], presented[0]) or STREAM_TOKEN_INVALID


def presented_token(scope: Scope) -> tuple[str, str] | None:
    """(job id, token) when the request is a GET of a job's events with a stream token in its URL."""
    match = EVENTS_PATH.match(scope["path"])
    if match is None or scope.get("method") != "GET":
        return None
    for part in scope.get("query_string", b"").decode("latin-1").split("&"):
        name, _, value = part.partition("=")
        if name == QUERY_PARAM and value:
            return match["job_id"], value
    return None
