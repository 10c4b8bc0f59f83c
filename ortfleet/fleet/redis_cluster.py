"""A Redis Cluster of primaries and their replicas on free ports of this machine, for benchmarks, drills
and tests: built with plain cluster commands (no redis-cli), watched for health and failovers, and a slot
moved between primaries the way `redis-cli --cluster reshard` moves it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis as SyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ortfleet.fleet.processes import free_port, redis_server_binary, stop, wait_for_port

SLOTS = 16384
HOST = "127.0.0.1"


@dataclass(frozen=True)
class NodeView:
    """One line of CLUSTER NODES: a node as the node that was asked sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    config_epoch: int
    connected: bool
    slots: tuple[tuple[int, int], ...]  # ranges, both ends included; importing/migrating marks left out

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    def serves(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def parse_nodes(text: str) -> list[NodeView]:
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        node_id, address, flags, primary, _ping, _pong, epoch, link, *slots = line.split()
        port = int(address.split("@")[0].rsplit(":", 1)[1] or 0)
        ranges = []
        for item in slots:
            if item.startswith("["):
                continue
            low, _, high = item.partition("-")
            ranges.append((int(low), int(high or low)))
        nodes.append(
            NodeView(
                node_id,
                port,
                frozenset(flags.split(",")),
                None if primary == "-" else primary,
                int(epoch),
                link == "connected",
                tuple(ranges),
            )
        )
    return nodes


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """0..16383 split over `primaries` as redis-cli splits it (three: 0-5460, 5461-10922, 10923-16383)."""
    per_node = SLOTS / primaries
    ranges, first, cursor = [], 0, 0.0
    for i in range(primaries):
        last = SLOTS - 1 if i == primaries - 1 else round(cursor + per_node - 1)
        ranges.append((first, last))
        first, cursor = last + 1, cursor + per_node
    return ranges


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    data: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class RedisCluster:
    """Its nodes keep their data in `directory` (AOF on unless `appendonly` is False) and log to
    `log_dir` (`directory` by default)."""

    directory: Path
    log_dir: Path | None = None
    appendonly: bool = True
    nodes: dict[int, ClusterNode] = field(default_factory=dict)

    @property
    def ports(self) -> list[int]:
        """Every node's port: the primaries as started first, then their replicas."""
        return list(self.nodes)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.ports[0]}/0"

    def client(self, port: int) -> SyncRedis:
        return SyncRedis(
            host=HOST, port=port, socket_timeout=2, socket_connect_timeout=1, decode_responses=True
        )

    def live_ports(self) -> list[int]:
        return [port for port, node in self.nodes.items() if node.alive]

    def start(self, primaries: int = 3, replicas_each: int = 1) -> None:
        taken: set[int] = set()
        for _ in range(primaries * (1 + replicas_each)):
            port, bus_port = self._free_port(taken), self._free_port(taken)
            data = self.directory / f"redis-cluster-{port}"
            data.mkdir(parents=True)
            self.nodes[port] = ClusterNode(port, bus_port, data)
            self._spawn(self.nodes[port])
        for node in self.nodes.values():
            assert node.process is not None
            wait_for_port(node.port, node.process, "redis-server (cluster)")
        ids = {port: self.node_id(port) for port in self.ports}
        first = self.nodes[self.ports[0]]
        for epoch, port in enumerate(self.ports, start=1):
            with self.client(port) as node:
                # distinct epochs at once, as redis-cli gives them: no collisions to settle by gossip
                node.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
                if port != first.port:
                    node.execute_command("CLUSTER", "MEET", HOST, first.port, first.bus_port)
        primary_ports = self.ports[:primaries]
        for port, (low, high) in zip(primary_ports, slot_ranges(primaries), strict=True):
            with self.client(port) as node:
                node.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        self.wait_until(lambda: self._all_known(set(ids.values())), "every cluster node knows every other")
        for i, port in enumerate(self.ports[primaries:]):
            with self.client(port) as replica:
                replica.execute_command("CLUSTER", "REPLICATE", ids[primary_ports[i % primaries]])
        self.wait_until(self.healthy, "the cluster is ok with every replica in sync")

    @staticmethod
    def _free_port(taken: set[int]) -> int:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return port

    def _spawn(self, node: ClusterNode) -> None:
        command = [redis_server_binary(), "--port", str(node.port), "--bind", HOST, "--dir", str(node.data)]
        command += ["--cluster-enabled", "yes", "--cluster-config-file", str(node.data / "nodes.conf")]
        # its own bus port: port + 10000 may be taken or past 65535
        command += ["--cluster-port", str(node.bus_port), "--cluster-node-timeout", "1000"]
        command += ["--cluster-replica-validity-factor", "0"]  # a replica may take over however long down
        command += [
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "no",
        ]
        command += ["--repl-diskless-sync-delay", "0"]  # a replica's first sync at once, not after 5 s
        command += ["--logfile", str((self.log_dir or self.directory) / f"redis-cluster-{node.port}.log")]
        node.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _all_known(self, ids: set[str]) -> bool:
        for port in self.ports:
            known = {n.node_id for n in self.cluster_nodes(port) if not n.failing and n.connected}
            if known != ids:
                return False
        return True

    def node_id(self, port: int) -> str:
        with self.client(port) as node:
            return str(node.execute_command("CLUSTER", "MYID"))

    def cluster_nodes(self, port: int) -> list[NodeView]:
        """The cluster as the node on `port` sees it."""
        with self.client(port) as node:
            return parse_nodes(node.execute_command("CLUSTER", "NODES"))

    def cluster_info(self, port: int) -> dict[str, str]:
        with self.client(port) as node:
            text: str = node.execute_command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def _view(self) -> list[NodeView]:
        """The cluster as the first live node sees it."""
        live = self.live_ports()
        assert live, "no cluster node is running"
        return self.cluster_nodes(live[0])

    def primary_ports(self) -> list[int]:
        """The live primaries now, as a live node sees them (a primary with no slots too)."""
        live = set(self.live_ports())
        return sorted(n.port for n in self._view() if n.is_primary and not n.failing and n.port in live)

    def replica_ports(self, primary_port: int) -> list[int]:
        """The live replicas of the primary on `primary_port` now, as a live node sees them."""
        view, live = self._view(), set(self.live_ports())
        primary = next(n.node_id for n in view if n.port == primary_port)
        return sorted(n.port for n in view if n.primary_id == primary and not n.failing and n.port in live)

    def node_of_slot(self, slot: int) -> int:
        """The port of the primary serving `slot` now: of the live nodes that say they serve it, the one
        with the newest config epoch (the one the cluster settles on)."""
        claims = []
        for port in self.live_ports():
            myself = next(n for n in self.cluster_nodes(port) if "myself" in n.flags)
            if myself.is_primary and myself.serves(slot):
                claims.append((myself.config_epoch, port))
        assert claims, f"no live primary serves slot {slot}"
        return max(claims)[1]

    def kill(self, port: int) -> None:
        """SIGKILL: no shutdown, no last AOF write."""
        process = self.nodes[port].process
        assert process is not None
        process.kill()
        process.wait()

    def restart(self, port: int) -> None:
        """Starts a stopped node again on its port, data and nodes.conf; it rejoins on its own."""
        node = self.nodes[port]
        assert not node.alive, f"the node on port {port} is running"
        self._spawn(node)
        assert node.process is not None
        wait_for_port(port, node.process, "redis-server (cluster)")

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what} within {timeout_s:g} s; the cluster now:\n{self.describe()}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and sees all 16384 slots on the same live primaries, and
        every live replica's link to its primary is up."""
        live = set(self.live_ports())
        owners: list[int] | None = None
        try:
            for port in live:
                if self.cluster_info(port).get("cluster_state") != "ok":
                    return False
                with self.client(port) as node:
                    replication = node.info("replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False
                seen = [0] * SLOTS
                for n in self.cluster_nodes(port):
                    if not n.slots:
                        continue
                    if not n.is_primary or n.failing or n.port not in live:
                        return False
                    for low, high in n.slots:
                        seen[low : high + 1] = [n.port] * (high - low + 1)
                if 0 in seen or (owners is not None and seen != owners):
                    return False
                owners = seen
        except (RedisConnectionError, RedisTimeoutError):
            return False
        return True

    def wait_failover(self, old_primary_port: int, timeout_s: float = 30.0) -> None:
        """Until other nodes serve the old primary's slots and the cluster is ok again."""

        def failed_over() -> bool:
            if not self.healthy():
                return False
            return all(
                not (n.port == old_primary_port and n.slots)
                for port in self.live_ports()
                for n in self.cluster_nodes(port)
            )

        self.wait_until(failed_over, f"a failover of the primary on port {old_primary_port}", timeout_s)

    def begin_migration(self, slot: int, to_port: int) -> SlotMigration:
        """Marks `slot` IMPORTING on `to_port` and MIGRATING on its primary; no key moved yet."""
        source = self.node_of_slot(slot)
        assert source != to_port, f"slot {slot} is already on port {to_port}"
        migration = SlotMigration(self, slot, source, to_port, self.node_id(source), self.node_id(to_port))
        with self.client(to_port) as target:
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", migration.source_id)
        with self.client(source) as node:
            node.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", migration.target_id)
        return migration

    def migrate_slot(self, slot: int, to_port: int) -> None:
        """Moves `slot` and its keys from its primary to the primary on `to_port`."""
        self.begin_migration(slot, to_port).finish()

    def describe(self) -> str:
        lines = []
        for port, node in self.nodes.items():
            if not node.alive:
                lines.append(f"{port}: not running")
                continue
            try:
                state = self.cluster_info(port).get("cluster_state")
                myself = next(n for n in self.cluster_nodes(port) if "myself" in n.flags)
                lines.append(f"{port}: {state} {','.join(sorted(myself.flags))} slots {list(myself.slots)}")
            except (RedisConnectionError, RedisTimeoutError) as e:
                lines.append(f"{port}: {e}")
        return "\n".join(lines)

    def stop_all(self) -> None:
        running = [node.process for node in self.nodes.values() if node.process is not None]
        for process in running:
            if process.poll() is None:
                process.terminate()
        for process in running:
            stop(process)


@dataclass
class SlotMigration:
    """A slot between IMPORTING/MIGRATING and its new owner: `move_keys` moves some or all of its keys,
    `finish` moves the rest and gives the slot to the target on every primary."""

    cluster: RedisCluster
    slot: int
    source: int
    target: int
    source_id: str
    target_id: str

    def move_keys(self, limit: int | None = None, batch: int = 100) -> int:
        """MIGRATEs up to `limit` (all, if None) of the slot's keys still on the source; their number."""
        moved = 0
        with self.cluster.client(self.source) as source:
            while limit is None or moved < limit:
                count = batch if limit is None else min(batch, limit - moved)
                keys: list[str] = source.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, count)
                if not keys:
                    break
                source.execute_command("MIGRATE", HOST, self.target, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
        return moved

    def finish(self) -> None:
        self.move_keys()
        # the target first: once it owns the slot its config epoch is the newest
        others = [p for p in self.cluster.primary_ports() if p not in (self.source, self.target)]
        for port in [self.target, self.source, *others]:
            with self.cluster.client(port) as node:
                node.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)
