from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.redis_url import mask_url

LogLevel = Literal["debug", "info", "warning", "error"]


def _default_model_cache() -> Path:
    from common.modelbuild.cache import default_cache_root

    return default_cache_root()


class FleetSettings(BaseSettings):
    """Settings every ortfleet process reads (env prefix ``ORTFLEET_``, ``.env`` supported)."""

    model_config = SettingsConfigDict(env_prefix="ORTFLEET_", env_file=".env", extra="ignore")

    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis to use, as a URL: redis://[:password@]host:port/db, rediss:// for TLS.",
    )
    job_ttl_s: int = Field(
        86_400, ge=60, description="Seconds a job's record and token stream are kept after submission."
    )
    model_cache: Path = Field(
        default_factory=_default_model_cache,
        description="Folder where `ortfleet model default` builds and keeps converted models.",
    )
    log_level: LogLevel = Field("info", description="Log level of the process.")
    heartbeat_ttl_s: float = Field(
        5.0,
        gt=0.5,
        description="Seconds a worker's registration and job leases live without a heartbeat; a dead "
        "worker's jobs are resumed elsewhere after this.",
    )


class GatewaySettings(FleetSettings):
    """Settings of the HTTP gateway."""

    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on.")
    max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body accepted; larger bodies get 413."
    )
    max_wait_s: float = Field(
        60.0, gt=0, description="Longest long-poll (`GET /v1/jobs/{id}?wait=S`) a client may ask for."
    )
    sse_keepalive_s: float = Field(
        15.0, gt=0, description="Seconds between SSE keep-alive comments on an idle stream."
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a job that does not set it.")
    max_queued_jobs: int = Field(
        10_000, ge=1, description="Jobs that may wait in one model's queue; more get 429 with Retry-After."
    )
    max_queued_tokens: int = Field(
        4_000_000,
        ge=1,
        description="Prompt and generated tokens (prompt estimated as characters / 4, plus max_tokens) "
        "that may wait in one model's queue; more get 429 with Retry-After.",
    )
    queue_timeout_s: float = Field(
        900.0,
        ge=0,
        description="A job still queued this long after submission fails as 'expired in queue' instead of "
        "running late; 0 lets jobs wait forever.",
    )
    api_keys: SecretStr | None = Field(
        None,
        description="API keys the gateway accepts, as comma-separated NAME:KEY pairs; with these or a keys "
        "file, every route but /healthz and /readyz needs `Authorization: Bearer KEY`.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="Keys file written by `ortfleet keys create` (hashes only); re-read when it changes.",
    )
    metrics_api_key: SecretStr | None = Field(
        None, description="When set, the gateway's /metrics needs `Authorization: Bearer` this key."
    )
    allow_anonymous: bool = Field(
        False,
        description="Let the gateway listen on a non-loopback address with no API keys (--allow-anonymous).",
    )
    key_max_concurrent_jobs: int = Field(
        64, ge=1, description="Active (queued or running) jobs a key may have, unless its own limit is set."
    )
    key_requests_per_minute: int = Field(
        1200,
        ge=1,
        description="Requests a key may make per minute, across all gateways, unless its own is set.",
    )
    max_header_bytes: int = Field(
        16_384, ge=1024, description="Largest request head (request line and headers) the gateway reads."
    )


class WorkerSettings(FleetSettings):
    """Settings of a generation worker (command-line flags override them)."""

    model: Path | None = Field(None, description="ORT-GenAI model folder to serve (--model).")
    device: str = Field("auto", description="Device: auto, cpu, cuda or cuda:N (--device).")
    name: str | None = Field(
        None, description="Served model name (--name); defaults to the model folder's name."
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="Engine batch rows (requests generated together); default from genai_config "
        "(the static scheduler's default is 4).",
    )
    max_attempts: int = Field(
        3, ge=1, description="Times a job may be started before it fails (a job that kills workers)."
    )
    claim_poll_s: float = Field(
        1.0,
        gt=0,
        description="Fallback poll of the queue; new jobs wake idle workers at once through Redis pub/sub.",
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, seconds running jobs get to finish before the rest are handed back "
        "to the queue (they resume on another worker from the tokens already streamed).",
    )
    step_delay_s: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Testing aid: pause this long after each engine step to act as a slower device "
        "(fault drills, balancing experiments); 0 is off.",
    )
    static_batch_window_s: float = Field(
        0.02,
        ge=0,
        le=1,
        description="On the static scheduler (a batch runs to its end before it admits anyone): the "
        "longest a worker waits for the jobs it expects (as many as its last batch had) before it "
        "starts a batch with fewer; a tenth of it for jobs submitted together; 0 starts at once.",
    )
    publish_max_batch: int = Field(
        64, ge=1, description="Most tokens written to a job's stream in one Redis round trip."
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the worker's Prometheus /metrics (--metrics-port); 0 picks a free one. The "
        "URL is in the worker's registry entry (`ortfleet status` shows it).",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the worker's /metrics listens on; 0.0.0.0 to be scraped from other hosts.",
    )


def effective_settings(settings: BaseSettings) -> dict[str, Any]:
    """The settings as plain values, secrets masked (passwords in URLs included)."""
    shown: dict[str, Any] = {}
    for name, value in settings:
        if isinstance(value, SecretStr):
            raw = value.get_secret_value()
            shown[name] = mask_url(raw) if "://" in raw else ("**********" if raw else "")
        elif isinstance(value, Path):
            shown[name] = str(value)
        else:
            shown[name] = value
    return shown
