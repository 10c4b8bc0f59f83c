"""The `redis_cluster` fixture: a Redis Cluster of three primaries with a replica each
(ortfleet/fleet/redis_cluster.py), started on free ports for a test, its logs with the test logs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ortfleet.fleet.redis_cluster import RedisCluster
from tests.conftest import LOGS

__all__ = ["RedisCluster", "redis_cluster"]


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """Three primaries with a replica each, ok and in sync."""
    cluster = RedisCluster(tmp_path, LOGS)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop_all()
