"""The settings every ortfleet process reads, and how `ortfleet config` shows them. Each process's own
class extends `FleetSettings`: common/gateway_settings.py, common/worker_settings.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.model_folder import default_cache_root
from common.redis_url import check_redis_url, mask_url
from common.stores import Store, home_store, model_stores

LogLevel = Literal["debug", "info", "warning", "error"]
MAX_CLUSTER_STORES = 1024  # a model's stores on one Redis Cluster


class FleetSettings(BaseSettings):
    """Settings every ortfleet process reads (env prefix ``ORTFLEET_``, ``.env`` supported)."""

    model_config = SettingsConfigDict(env_prefix="ORTFLEET_", env_file=".env", extra="ignore")

    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis to use, as a URL: redis://[:password@]host:port/db, rediss:// for TLS, "
        "unix:///path/to/redis.sock?db=0 for a Unix socket, or "
        "redis+sentinel://[:password@]host:port,host:port/SERVICE[/db][?sentinel_password=...] to follow "
        "the primary that Redis Sentinel names.",
    )
    redis_shards: dict[str, list[SecretStr] | int] = Field(
        default_factory=dict,
        description="Models whose queue, jobs and streams live in stores of their own, as JSON: "
        '{"model": "redis://host:6379/0", ...}, or a list of URLs for a model whose jobs spread over '
        'several Redis servers (its stores: {"model": ["redis://a:6379/0", "redis://b:6379/0"]}), or, '
        "where redis_url is a Redis Cluster, a number of stores on that cluster "
        '({"model": 3}: three hash tags, one per primary of a cluster whose slots are split evenly). Each '
        "worker serves one store, see ORTFLEET_STORE, and gateways place each job on the store with the "
        "fewest jobs for its rows. Other models, API keys, files, batches and responses use redis_url. "
        "Give every gateway and worker the same map.",
    )
    prefix_cache_scope: Literal["key", "fleet"] = Field(
        "key",
        description="Whose cached prompt prefixes a request may reuse (counted in cached_tokens, and "
        "sooner to a first token): `key`, only those of its own API key's requests (or of its group in "
        "prefix_cache_groups); `fleet`, those of every key's, for a single-tenant fleet (a key may then "
        "learn whether another key's prompt starts with a guessed text). A gateway without API keys has one "
        "scope for all. Either way, requests with different cache_salt values share nothing. og.Engine "
        "workers (paged-attention models on GPUs) reuse prefixes only with `fleet`, and then whatever the "
        "cache_salt: og.Engine's own prefix cache knows no scope. Give every gateway and worker the same "
        "value.",
    )
    job_ttl_s: int = Field(
        86_400,
        ge=60,
        description="Seconds a job's record, token stream and idempotency entry are kept after the job ends "
        "(succeeded, failed or cancelled); nothing of a queued or running job expires, however long it waits "
        "or runs.",
    )
    model_cache: Path = Field(
        default_factory=default_cache_root,
        description="Folder where `ortfleet model default` builds and keeps converted models.",
    )
    log_level: LogLevel = Field("info", description="Log level of the process.")
    heartbeat_ttl_s: float = Field(
        5.0,
        gt=0.5,
        description="Seconds a worker's registration and job leases live without a heartbeat; a dead "
        "worker's jobs are resumed elsewhere after this.",
    )

    allow_evicting_redis: bool = Field(
        False,
        description="Start on a Redis whose maxmemory-policy evicts keys (anything but noeviction), which "
        "can drop accepted jobs, streams and files without a word; without it such a Redis is refused at "
        "start and reported by /readyz while it runs.",
    )

    @property
    def cluster_stores(self) -> bool:
        """Whether the shard map gives some model stores on a Redis Cluster (redis_url must be one)."""
        return any(isinstance(given, int) for given in self.redis_shards.values())

    def home_store(self, cluster: bool) -> Store:
        """The store at redis_url (`cluster`: a Redis Cluster, as asked at start or implied by the map)."""
        return home_store(self.redis_url.get_secret_value(), cluster or self.cluster_stores)

    def all_stores(self, cluster: bool = False) -> list[Store]:
        """The home store, then every store of the shard map, each once."""
        home = self.home_store(cluster)
        return list(
            dict.fromkeys(
                [home, *(s for model in self.redis_shards for s in self.stores_for(model, cluster))]
            )
        )

    def stores_for(self, model: str, cluster: bool = False) -> list[Store]:
        """The stores that hold `model`'s jobs (one, unless the shard map gives it several)."""
        given = self.redis_shards.get(model)
        if isinstance(given, list):
            return model_stores(self.home_store(cluster), model, [url.get_secret_value() for url in given])
        return model_stores(self.home_store(cluster), model, given)

    @field_validator("redis_shards", mode="before")
    @classmethod
    def _one_url_is_one_store(cls, shards: Any) -> Any:
        if isinstance(shards, dict):
            return {model: [urls] if isinstance(urls, str) else urls for model, urls in shards.items()}
        return shards

    @field_validator("redis_shards")
    @classmethod
    def _shard_urls(cls, shards: dict[str, list[SecretStr] | int]) -> dict[str, list[SecretStr] | int]:
        for model, urls in shards.items():
            if not model:
                raise ValueError("a model name in redis_shards is empty")
            if isinstance(urls, int):
                if not 1 <= urls <= MAX_CLUSTER_STORES:
                    raise ValueError(
                        f"model {model!r} is given {urls} stores on the cluster in redis_shards: give 1 to "
                        f"{MAX_CLUSTER_STORES}"
                    )
                continue
            if not urls:
                raise ValueError(f"model {model!r} has an empty list of Redis URLs in redis_shards")
            plain = [url.get_secret_value() for url in urls]
            if len(set(plain)) < len(plain):
                raise ValueError(f"model {model!r} names one Redis twice in redis_shards")
            for url in plain:
                try:
                    check_redis_url(url)
                except ValueError as e:
                    raise ValueError(f"the Redis of model {model!r}: {e}") from e
        return shards

    @field_validator("redis_url")
    @classmethod
    def _usable_redis_url(cls, url: SecretStr) -> SecretStr:
        check_redis_url(url.get_secret_value())
        return url


def effective_settings(settings: BaseSettings) -> dict[str, Any]:
    """The settings as plain values, secrets masked (passwords in URLs included)."""
    shown: dict[str, Any] = {}
    for name, value in settings:
        if isinstance(value, SecretStr):
            shown[name] = _masked(value)
        elif isinstance(value, dict):
            shown[name] = {k: _shown(v) for k, v in value.items()}
        elif isinstance(value, Path):
            shown[name] = str(value)
        else:
            shown[name] = value
    return shown


def _shown(value: Any) -> Any:
    """A map's value as shown: a secret masked; a list of one secret (a model's one store) as that one."""
    if isinstance(value, list):
        shown = [_shown(v) for v in value]
        return shown[0] if len(shown) == 1 else shown
    return _masked(value) if isinstance(value, SecretStr) else value


def _masked(value: SecretStr) -> str:
    raw = value.get_secret_value()
    return mask_url(raw) if "://" in raw else ("**********" if raw else "")
