"""What a Redis must be for ortfleet to keep the work it accepted, read from the server itself: a
`maxmemory-policy` that never evicts keys, and persistence (an append-only file, or RDB snapshots) so
that a restart keeps its data. Gateways and workers read it with `CONFIG GET` when they start and
periodically after; a Redis where CONFIG is disabled (managed Redis often renames it) cannot be
checked, and is said to be so."""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ResponseError

SAFE_POLICY = "noeviction"
ALLOW_EVICTION = "ORTFLEET_ALLOW_EVICTING_REDIS"
_PARAMETERS = ("maxmemory-policy", "appendonly", "save")


@dataclass(frozen=True)
class StoreConfig:
    """A Redis's memory policy and persistence, or why they could not be read (`unreadable`)."""

    policy: str = ""
    appendonly: bool = False
    save: str = ""
    unreadable: str | None = None
    cluster: bool = False  # the server is a node of a Redis Cluster

    @classmethod
    def parse(cls, values: dict[str, str]) -> StoreConfig:
        return cls(
            policy=values.get("maxmemory-policy", ""),
            appendonly=values.get("appendonly", "no") == "yes",
            save=values.get("save", "").strip(),
        )

    @property
    def checked(self) -> bool:
        return self.unreadable is None

    @property
    def evicts(self) -> bool:
        """Whether Redis may drop keys when memory runs out (any policy but noeviction: the volatile
        ones drop keys with a TTL, which every job key has)."""
        return self.checked and self.policy != SAFE_POLICY

    @property
    def persists(self) -> bool:
        return self.appendonly or bool(self.save)

    def eviction_refusal(self, label: str) -> str:
        """The line that refuses a Redis that evicts keys."""
        return (
            f"Redis at {label} evicts keys when its memory is full (maxmemory-policy {self.policy}): it "
            "would drop accepted jobs, streams and files without a word. Set maxmemory-policy "
            f"{SAFE_POLICY} (redis.conf, or CONFIG SET maxmemory-policy {SAFE_POLICY}), or set "
            f"{ALLOW_EVICTION}=true to accept that loss"
        )

    def warnings(self, label: str, allow_eviction: bool) -> list[str]:
        """What an operator should hear about this Redis, short of refusing it."""
        if not self.checked:
            return [
                f"the memory policy and persistence of Redis at {label} could not be checked (CONFIG GET "
                f"refused: {self.unreadable}); make sure it is maxmemory-policy {SAFE_POLICY} with an "
                "append-only file, or accepted work may be lost"
            ]
        said = []
        if self.evicts and allow_eviction:
            said.append(
                f"Redis at {label} evicts keys when its memory is full (maxmemory-policy {self.policy}), "
                f"allowed by {ALLOW_EVICTION}: accepted jobs, streams and files may be lost"
            )
        if not self.persists:
            said.append(
                f'Redis at {label} persists nothing (appendonly no, save ""): a restart loses every '
                "queued and running job and every stream; run it with appendonly yes"
            )
        return said


def _unreadable(error: ResponseError) -> StoreConfig:
    return StoreConfig(unreadable=" ".join(str(error).split()))


def read_config_blocking(client: SyncRedis) -> StoreConfig:
    """The server's settings through a synchronous client (at start)."""
    values: dict[str, str] = {}
    try:
        for parameter in _PARAMETERS:
            values |= client.config_get(parameter)  # type: ignore[arg-type]
    except ResponseError as e:  # CONFIG disabled, renamed or not permitted to this user
        return _unreadable(e)
    return StoreConfig.parse(values)


async def read_config(redis: Redis) -> StoreConfig:
    """The server's settings (periodically)."""
    values: dict[str, str] = {}
    try:
        for parameter in _PARAMETERS:
            values |= await redis.config_get(parameter)
    except ResponseError as e:
        return _unreadable(e)
    return StoreConfig.parse(values)
