"""A store's connections on a Redis Cluster: each goes to the primary that serves the store's hash slot.

Every key of a store carries its hash tag (common/keys.py), so a store lives in one slot, served by one
primary at a time. A store's client is therefore an ordinary client whose connections are pinned to that
primary (`SlotRoute`): its scripts, MULTI/WATCH transactions, pipelines, held connections, pub/sub and the
relay's stream reads run as on one Redis. A connection that meets a redirection (`MOVED`: the slot moved
to another primary, after a failover or a resharding; `ASK` or `TRYAGAIN`: it is moving now;
`CLUSTERDOWN`), a demoted primary (`READONLY`) or a node that does not answer drops itself and raises
ConnectionError; the client's retries then reconnect to the slot's primary of the moment, which MOVED
names or the cluster's slot map (`CLUSTER SLOTS`, asked of any node known) tells.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0  # how long a node is given to answer CLUSTER SLOTS before the next is asked
# Replies that say a command reached a node that does not serve its slot now.
_REDIRECTIONS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


class SlotRoute:
    """Which node serves one hash slot now, as this process last learned it; shared by the connections of
    one store (its client's pool, the relay's readers and subscription)."""

    def __init__(self, seeds: list[tuple[str, int]], tag: str, connection_kwargs: dict[str, Any]) -> None:
        self.slot = key_slot(tag.encode())
        self.tag = tag
        self._known = list(dict.fromkeys(seeds))  # every node seen, the seeds first
        self._address: tuple[str, int] | None = None
        self._kwargs = {
            k: v
            for k, v in connection_kwargs.items()
            if k in ("username", "password", "ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile")
        }
        self._ssl = bool(connection_kwargs.get("ssl"))
        self._asking: asyncio.Lock | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        return self._address

    def moved(self, address: tuple[str, int]) -> None:
        """A node answered MOVED to this address: the slot is served there now."""
        if address != self._address:
            logger.info("hash slot %d ({%s}) is served by %s:%d now", self.slot, self.tag, *address)
        self._address = address
        if address not in self._known:
            self._known.append(address)

    def lost(self) -> None:
        """The node of the slot did not answer, or no longer serves it: ask the cluster again."""
        self._address = None

    async def primary(self) -> tuple[str, int]:
        """The address of the slot's primary: the one known, or the one the cluster's slot map names."""
        if self._address is not None:
            return self._address
        if self._asking is None:
            self._asking = asyncio.Lock()
        async with self._asking:  # the connections that reconnect together ask once
            if self._address is None:
                self._address = await self._ask()
            return self._address

    async def _ask(self) -> tuple[str, int]:
        failures: list[str] = []
        for host, port in random.sample(self._known, len(self._known)):
            client = Redis(
                host=host,
                port=port,
                socket_timeout=ASK_TIMEOUT_S,
                socket_connect_timeout=ASK_TIMEOUT_S,
                decode_responses=True,
                ssl=self._ssl,
                **self._kwargs,
            )
            try:
                ranges: list[list[Any]] = await client.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
            except (RedisError, OSError) as e:
                failures.append(f"{host}:{port}: {e}")
                continue
            finally:
                await client.aclose()
            found = self._learn(ranges, host)
            if found is not None:
                return found
            failures.append(f"{host}:{port}: no primary serves hash slot {self.slot}")
        raise RedisConnectionError(
            f"no node of the Redis Cluster named the primary of hash slot {self.slot} ({'; '.join(failures)})"
        )

    def _learn(self, ranges: list[list[Any]], asked_host: str) -> tuple[str, int] | None:
        """Every node of a CLUSTER SLOTS reply joins those known; the primary of the slot, if any."""
        found = None
        for start, end, primary, *replicas in ranges:
            for node in (primary, *replicas):
                address = (str(node[0]) or asked_host, int(node[1]))
                if address not in self._known:
                    self._known.append(address)
            if int(start) <= self.slot <= int(end):
                found = (str(primary[0]) or asked_host, int(primary[1]))
        return found


def redirected(error: ResponseError, route: SlotRoute) -> RedisConnectionError | None:
    """The ConnectionError to raise in place of a reply that says the slot is served elsewhere (MOVED,
    ASK, TRYAGAIN, CLUSTERDOWN, READONLY), the route updated; None for any other error."""
    message = str(error)
    if isinstance(error, ReadOnlyError):
        route.lost()
        return RedisConnectionError(f"the node is no longer the primary of hash slot {route.slot}: {message}")
    if not message.startswith(_REDIRECTIONS):
        return None
    words = message.split()
    if words[0] == "MOVED" and len(words) >= 3:
        host, _, port = words[2].rpartition(":")
        if port.isdigit():
            route.moved((host.strip("[]"), int(port)))
    elif words[0] == "CLUSTERDOWN":
        route.lost()
    return RedisConnectionError(f"hash slot {route.slot} is not served here now ({message})")


class SlotConnection(Connection):
    """A connection to the primary of its route's slot, found when it connects."""

    def __init__(self, *, slot_route: SlotRoute, **kwargs: Any) -> None:
        self.slot_route = slot_route
        super().__init__(**kwargs)

    async def _connect(self) -> None:
        self.host, self.port = await self.slot_route.primary()
        try:
            await super()._connect()  # type: ignore[no-untyped-call]
        except (TimeoutError, OSError):
            self.slot_route.lost()
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as e:
            error = redirected(e, self.slot_route)
            if error is None:
                raise
            await self.disconnect()
            raise error from e


class SlotSSLConnection(SlotConnection, SSLConnection):
    pass


def route_of(connection: Any) -> SlotRoute | None:
    """The slot route of a connection (None: not a store on a cluster)."""
    route = getattr(connection, "slot_route", None)
    return route if isinstance(route, SlotRoute) else None
