"""Keyspaces: one Redis keeps today's names; on a Redis Cluster every key of a store carries its hash tag,
and a model's stores spread over the slot space; a store's connections follow its slot."""

from __future__ import annotations

import inspect

import pytest
from redis.crc import key_slot
from redis.exceptions import ReadOnlyError, ResponseError

from common.keys import HOME_TAG, STANDALONE, Keyspace, store_tag
from common.redis_cluster import SlotRoute, redirected
from common.settings import FleetSettings
from common.stores import Store

pytestmark = pytest.mark.unit


def every_name(keys: Keyspace) -> list[str]:
    """Every key and channel the keyspace names, each function given sample arguments."""
    names = [
        value for value in vars(keys).values() if isinstance(value, str) and value.startswith("ortfleet")
    ]
    for name, method in inspect.getmembers(keys, inspect.ismethod):
        if name.startswith("_"):
            continue
        arity = len(inspect.signature(method).parameters)
        made = method(*(["sample"] * arity))
        names += list(made) if isinstance(made, tuple) else [made]
    return [name for name in names if isinstance(name, str)]


def test_one_redis_keeps_the_names_without_a_tag() -> None:
    assert STANDALONE.job("job_1") == "ortfleet:job:job_1"
    assert STANDALONE.arq_job("job_1") == "arq:job:job_1"
    assert STANDALONE.workers == "ortfleet:workers"
    assert STANDALONE.queue("m", "batch") == "ortfleet:queue:m:batch"
    assert STANDALONE.idempotency_try("d") == "ortfleet:idem:d:trying"
    assert all("{" not in name for name in every_name(STANDALONE))


def test_every_key_and_channel_of_a_cluster_store_hashes_to_its_tag_slot() -> None:
    keys = Keyspace(store_tag("smollm2", 1, 3))
    names = every_name(keys)
    assert len(names) > 40
    slots = {key_slot(name.encode()) for name in names}
    assert slots == {key_slot(keys.tag.encode())}, names  # type: ignore[union-attr]
    assert keys.job("job_1") == f"ortfleet:{{{keys.tag}}}:job:job_1"
    assert keys.arq_job("job_1") == f"arq:job:{{{keys.tag}}}:job_1"


@pytest.mark.parametrize("stores", [1, 2, 3, 5, 16])
def test_a_models_stores_lie_in_equal_parts_of_the_slot_space_one_each(stores: int) -> None:
    tags = [store_tag("my model {v2}", i, stores) for i in range(stores)]
    assert len(set(tags)) == stores
    parts = [key_slot(tag.encode()) * stores // 16384 for tag in tags]
    assert parts == list(range(stores))
    assert all("{" not in tag and "}" not in tag and " " not in tag for tag in tags)
    assert tags == [store_tag("my model {v2}", i, stores) for i in range(stores)]  # every process agrees


def test_a_tag_with_braces_is_refused() -> None:
    with pytest.raises(ValueError, match="hash tag"):
        Keyspace("a}b")


def test_the_shard_map_gives_a_model_stores_on_the_cluster_as_a_number() -> None:
    settings = FleetSettings(
        redis_url="redis://10.0.0.1:7000/0", redis_shards={"big": 3, "own": "redis://h:1/0"}
    )  # type: ignore[arg-type]
    assert settings.cluster_stores
    big = settings.stores_for("big")
    assert [store.url for store in big] == ["redis://10.0.0.1:7000/0"] * 3
    assert len({store.keys for store in big}) == 3 and all(store.cluster for store in big)
    assert settings.stores_for("other") == [Store("redis://10.0.0.1:7000/0", Keyspace(HOME_TAG))]
    assert settings.stores_for("own") == [Store("redis://h:1/0", STANDALONE)]
    assert len(settings.all_stores()) == 5
    plain = FleetSettings(redis_url="redis://10.0.0.1:6379/0")  # type: ignore[arg-type]
    assert plain.stores_for("any") == [Store("redis://10.0.0.1:6379/0", STANDALONE)]
    assert plain.stores_for("any", cluster=True)[0].keys.tag == HOME_TAG
    with pytest.raises(ValueError, match="give 1 to"):
        FleetSettings(redis_shards={"big": 0})  # type: ignore[arg-type]


def test_a_redirection_points_the_route_at_the_slots_new_node() -> None:
    route = SlotRoute([("10.0.0.1", 7000)], "t", {})
    route.moved(("10.0.0.1", 7000))
    error = redirected(ResponseError(f"MOVED {route.slot} 10.0.0.2:7001"), route)
    assert error is not None and route.address == ("10.0.0.2", 7001)
    assert redirected(ResponseError("ASK 1 10.0.0.3:7002"), route) is not None
    assert route.address == ("10.0.0.2", 7001)  # ASK is for one command: the slot stays where it was
    assert redirected(ResponseError("TRYAGAIN Multiple keys request during rehashing"), route) is not None
    assert redirected(ResponseError("ERR wrong number of arguments"), route) is None
    assert redirected(ReadOnlyError("You can't write against a read only replica."), route) is not None
    assert route.address is None  # a demoted primary: the slot map is asked again
