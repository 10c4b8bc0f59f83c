"""A job's cache scope: whose cached prompt prefixes it may reuse, and who may reuse its own.

The scope is a digest of who shares (the job's API key, the key's group in ORTFLEET_PREFIX_CACHE_GROUPS, or
the whole fleet with ORTFLEET_PREFIX_CACHE_SCOPE=fleet) and of the request's cache_salt. It travels in the
job's payload; the worker's prefix cache chains every prompt block to it
(worker/engines/batcher/prefix_cache.py) and the routing hints start from it (common/prefix_hints.py), so a
job never reuses, counts or is routed by the prompt of a job in another scope."""

from __future__ import annotations

import hashlib
import json

from common.gateway_settings import GatewaySettings


def cache_scope(settings: GatewaySettings, key_name: str, salt: str | None) -> str:
    """The scope of a job of the key named `key_name` ("" without API keys: one scope) with `salt`."""
    if settings.prefix_cache_scope == "fleet":
        sharers = ["fleet"]
    else:
        group = next((g for g in settings.prefix_cache_groups if key_name in g), None)
        sharers = ["group", *sorted(group)] if group is not None else ["key", key_name]
    canonical = json.dumps({"sharers": sharers, "salt": salt}, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
