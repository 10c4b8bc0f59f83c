"""The `redis_cluster` fixture (tests/redis_cluster.py): a real Redis Cluster that starts ok, serves keys
from all its primaries, fails over a killed primary to its replica and moves a slot with its keys."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot
from redis.exceptions import ResponseError

from tests.redis_cluster import RedisCluster, redis_cluster  # noqa: F401 (a fixture)


def tags_on_each_primary(cluster: RedisCluster) -> dict[int, str]:
    """A hash tag whose slot is on each primary: {port: tag}."""
    primaries = set(cluster.primary_ports())
    tags: dict[int, str] = {}
    for i in range(1000):
        tag = f"t{i}"
        port = cluster.node_of_slot(key_slot(f"{{{tag}}}".encode()))
        tags.setdefault(port, tag)
        if set(tags) == primaries:
            return tags
    raise AssertionError(f"no hash tag for every primary: {tags}")


def test_starts_ok_with_a_replica_for_each_primary(
    redis_cluster: RedisCluster,  # noqa: F811 (the fixture)
) -> None:
    primaries = redis_cluster.primary_ports()
    assert len(primaries) == 3 and len(redis_cluster.ports) == 6
    replicas = {port: redis_cluster.replica_ports(port) for port in primaries}
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert {r[0] for r in replicas.values()} == set(redis_cluster.ports) - set(primaries)
    assert redis_cluster.healthy()
    ranges = {n.port: n.slots for n in redis_cluster.cluster_nodes(primaries[0]) if n.slots}
    assert sorted(ranges.values()) == [((0, 5460),), ((5461, 10922),), ((10923, 16383),)]
    assert set(ranges) == set(primaries)
    for port, [(low, high)] in ranges.items():
        assert redis_cluster.node_of_slot(low) == redis_cluster.node_of_slot(high) == port
    with redis_cluster.client(redis_cluster.ports[0]) as node:
        info = node.execute_command("CLUSTER", "INFO")
    assert "cluster_slots_ok:16384" in info and "cluster_known_nodes:6" in info


def test_keys_on_every_primary_and_a_failover(redis_cluster: RedisCluster) -> None:  # noqa: F811
    tags = tags_on_each_primary(redis_cluster)
    with ClusterClient.from_url(redis_cluster.url, decode_responses=True) as client:
        for port, tag in tags.items():
            for i in range(20):
                client.set(f"{{{tag}}}:{i}", f"{port}-{i}")
        for port, tag in tags.items():
            assert [client.get(f"{{{tag}}}:{i}") for i in range(20)] == [f"{port}-{i}" for i in range(20)]
    for port in tags:  # each primary holds its own tag's keys, and only those
        with redis_cluster.client(port) as node:
            assert node.dbsize() == 20

    url_port = int(redis_cluster.url.rsplit(":", 1)[1].split("/")[0])
    victim = next(port for port in tags if port != url_port)
    [replica] = redis_cluster.replica_ports(victim)
    with redis_cluster.client(victim) as node:
        assert node.execute_command("WAIT", 1, 1000) == 1
    redis_cluster.kill(victim)
    redis_cluster.wait_failover(victim)

    slot = key_slot(f"{{{tags[victim]}}}".encode())
    assert redis_cluster.node_of_slot(slot) == replica
    assert victim not in redis_cluster.primary_ports() and replica in redis_cluster.primary_ports()
    with ClusterClient.from_url(redis_cluster.url, decode_responses=True) as client:
        for port, tag in tags.items():
            assert [client.get(f"{{{tag}}}:{i}") for i in range(20)] == [f"{port}-{i}" for i in range(20)]

    redis_cluster.restart(victim)  # back as the replica of the one that took over
    redis_cluster.wait_until(
        lambda: redis_cluster.healthy() and redis_cluster.replica_ports(replica) == [victim],
        "the old primary back as a replica of its old replica",
    )
    assert redis_cluster.node_of_slot(slot) == replica


def test_a_slot_moves_with_its_keys(redis_cluster: RedisCluster) -> None:  # noqa: F811
    slot = key_slot(b"{moving}")
    source = redis_cluster.node_of_slot(slot)
    target = next(port for port in redis_cluster.primary_ports() if port != source)
    keys = [f"{{moving}}:{i}" for i in range(250)]
    with ClusterClient.from_url(redis_cluster.url, decode_responses=True) as client:
        for key in keys:
            client.set(key, key.upper())

        migration = redis_cluster.begin_migration(slot, target)
        assert migration.move_keys(limit=100) == 100
        # half moved: the client follows ASK to the target for the keys already there
        assert [client.get(key) for key in keys] == [key.upper() for key in keys]
        migration.finish()

    assert redis_cluster.node_of_slot(slot) == target
    with redis_cluster.client(target) as node:
        assert node.execute_command("CLUSTER", "KEYSLOT", keys[0]) == slot
        assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == len(keys)
        assert [node.get(key) for key in keys] == [key.upper() for key in keys]
    with redis_cluster.client(source) as node:
        assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        with pytest.raises(ResponseError, match=f"MOVED {slot} 127.0.0.1:{target}"):
            node.get(keys[0])
    redis_cluster.wait_until(redis_cluster.healthy, "the cluster ok after the move")
    with ClusterClient.from_url(redis_cluster.url, decode_responses=True) as client:
        assert [client.get(key) for key in keys] == [key.upper() for key in keys]
