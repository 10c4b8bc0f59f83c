"""Where a model's jobs live: its stores, each a Redis and a keyspace on it.

On standalone Redis servers a store is a whole server (ORTFLEET_REDIS_URL, or the servers that
ORTFLEET_REDIS_SHARDS lists for a model), its keys named without a tag. On a Redis Cluster a store is a
hash tag (common/keys.py): a model given `N` stores in ORTFLEET_REDIS_SHARDS has N tags on the cluster at
ORTFLEET_REDIS_URL, and the fleet's home data (API keys' counters, files, batches, responses, and the jobs
of models given no stores) has a tag of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.keys import HOME_TAG, STANDALONE, Keyspace, store_tag
from common.redis_url import mask_url


@dataclass(frozen=True)
class Store:
    url: str
    keys: Keyspace

    @property
    def cluster(self) -> bool:
        """Whether the store is a hash tag on a Redis Cluster (every keyspace there has one)."""
        return self.keys.tag is not None

    @property
    def label(self) -> str:
        """Its URL with the password masked, and its tag on a cluster."""
        return mask_url(self.url) + self.keys.shown


def home_store(url: str, cluster: bool) -> Store:
    """The store of the fleet's home data at ORTFLEET_REDIS_URL."""
    return Store(url, Keyspace(HOME_TAG) if cluster else STANDALONE)


def model_stores(home: Store, model: str, given: list[str] | int | None) -> list[Store]:
    """The stores of `model`: the URLs given, N tags on the home cluster, or the home store."""
    if given is None:
        return [home]
    if isinstance(given, int):
        return [Store(home.url, Keyspace(store_tag(model, i, given))) for i in range(given)]
    return [Store(url, STANDALONE) for url in given]
