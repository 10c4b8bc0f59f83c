from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.model_folder import default_cache_root
from common.redis_url import check_redis_url, mask_url

LogLevel = Literal["debug", "info", "warning", "error"]


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
    redis_shards: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Models whose queue, jobs and streams live on a Redis of their own, as JSON: "
        '{"model": "redis://host:6379/0", ...}. Other models, API keys, files, batches and responses '
        "use redis_url. Give every gateway and worker the same map.",
    )
    job_ttl_s: int = Field(
        86_400, ge=60, description="Seconds a job's record and token stream are kept after submission."
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

    def redis_url_for(self, model: str) -> str:
        """The URL of the Redis that holds `model`'s jobs."""
        return (self.redis_shards.get(model) or self.redis_url).get_secret_value()

    @field_validator("redis_shards")
    @classmethod
    def _shard_urls(cls, shards: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for model, url in shards.items():
            if not model:
                raise ValueError("a model name in redis_shards is empty")
            try:
                check_redis_url(url.get_secret_value())
            except ValueError as e:
                raise ValueError(f"the Redis of model {model!r}: {e}") from e
        return shards

    @field_validator("redis_url")
    @classmethod
    def _usable_redis_url(cls, url: SecretStr) -> SecretStr:
        check_redis_url(url.get_secret_value())
        return url


class GatewaySettings(FleetSettings):
    """Settings of the HTTP gateway."""

    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on.")
    redis_socket_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait for Redis to answer a command; a stalled Redis then gets the client a 503 "
        "instead of a hang.",
    )
    redis_connect_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait to open a connection to Redis."
    )
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
    prefix_route_wait_s: float = Field(
        1.0,
        ge=0.0,
        le=60.0,
        description="How long a chat waits at the head of its queue for the worker that holds the KV "
        "of its leading messages (a live worker with a free slot, at submission), before any worker may "
        "take it; 0 turns routing by prefix off.",
    )
    structured_output_prompt: bool = Field(
        True,
        description="Show a chat request's JSON schema (response_format json_schema, guided_json) to the "
        "model in a system message, as OpenAI does; decoding is constrained to it either way. Off: the "
        "messages reach the model as sent.",
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
        "file, every route but /healthz, /readyz, /health and /version needs `Authorization: Bearer KEY`.",
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
    metrics_per_key: bool = Field(
        False,
        description="Label the queued-job and served-token metrics by API key as well as by class (one "
        "series per key and class: enable only with a bounded number of keys).",
    )
    key_max_concurrent_jobs: int = Field(
        64, ge=1, description="Active (queued or running) jobs a key may have, unless its own limit is set."
    )
    key_max_prompt_tokens_in_flight: int = Field(
        65_536,
        ge=0,
        description="Prompt tokens a key's active (queued or running) jobs may hold in all, estimated at "
        "submission (about 4 characters a token, at most the model's context); a job that would pass it "
        "gets 429 too_many_prompt_tokens, unless the key has nothing in flight. 0: no limit.",
    )
    key_tokenize_chars_per_s: int = Field(
        200_000,
        ge=0,
        description="Characters a key may send to /tokenize per second, across all gateways, with a burst "
        "of 10 seconds' worth (one call of any size passes when the key has used none); past it, 429 "
        "tokenize_rate_exceeded. 0: no limit.",
    )
    key_requests_per_minute: int = Field(
        1200,
        ge=1,
        description="Requests a key may make per minute, across all gateways, unless its own is set.",
    )
    max_header_bytes: int = Field(
        16_384,
        ge=1024,
        description="Largest request head (request line and headers) the gateway reads; larger ones get 431.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Time a client has to send a request's head (line and headers) once it connects or "
        "starts a request; a slower one is disconnected with 408.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Time a client has to send a request's whole body after its head; a slower one is "
        "disconnected with 408.",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="Seconds an idle client connection stays open between requests (HTTP keep-alive). "
        "Longer than the idle timeout of HTTP clients' connection pools (5 s for httpx and the OpenAI SDK) "
        "and of the load balancers in front (60 s is common), so that they, not the gateway, close an "
        "idle connection: a gateway that closes one just as a client reuses it fails that request.",
    )
    max_json_depth: int = Field(
        32, ge=4, le=500, description="Deepest nesting of arrays and objects in a JSON body; deeper gets 400."
    )
    max_number_digits: int = Field(
        40, ge=20, le=1000, description="Most digits of a number in a JSON body; longer gets 400."
    )
    key_max_open_streams: int = Field(
        32,
        ge=1,
        description="Event streams, long-polls and waiting OpenAI calls one API key may hold open on one "
        "gateway at once; more get 429. A gateway without API keys has no such cap.",
    )
    max_file_bytes: int = Field(
        104_857_600,
        ge=1024,
        description="Largest file `POST /v1/files` accepts (read as a stream, kept in Redis); larger "
        "ones get 413.",
    )
    file_ttl_s: int = Field(
        86_400 * 7,
        ge=60,
        description="Seconds an uploaded file, and a batch's output and error files, are kept.",
    )
    batch_max_lines: int = Field(50_000, ge=1, description="Most requests one batch's input file may hold.")
    batch_max_in_flight: int = Field(
        32,
        ge=1,
        description="Lines of one batch queued or running at a time; the batch's driver feeds more as "
        "they end.",
    )
    batch_window_s: float = Field(
        86_400.0,
        gt=0,
        description="Seconds the `24h` completion window lasts; a batch not done by then expires (its "
        "unfinished lines go to the error file). Shorten it only to try expiry out.",
    )
    batch_lease_s: float = Field(
        10.0,
        gt=0.1,
        description="Seconds a gateway's lease on driving a batch lasts unrenewed; another gateway takes the "
        "batch over this long after its driver died.",
    )
    batch_tick_s: float = Field(
        0.5,
        gt=0,
        description="Seconds between two steps of a gateway's batch driver; while no batch is active, "
        "it looks for one every 10 of these (and at once for a batch created on its own gateway).",
    )
    queue_without_workers: bool = Field(
        False,
        description="Queue a job for a known model (served within the job TTL) that has no live worker "
        "now, instead of answering 503: for workers scaled to zero by an autoscaler on queue depth. The "
        "job waits at most ORTFLEET_QUEUE_TIMEOUT_S.",
    )
    cors_origins: str = Field(
        "",
        description="Comma-separated origins (https://app.example.com) whose web pages may call the API, "
        "or * for any; empty: no CORS headers.",
    )
    stream_token_secret: SecretStr | None = Field(
        None,
        description="Secret (16+ characters, the same on every gateway) that signs stream tokens, which let "
        "a browser's EventSource read a job's events on a keyed gateway; unset: no stream tokens.",
        min_length=16,
    )
    stream_token_ttl_s: int = Field(
        300, ge=10, le=86_400, description="Seconds a stream token stays valid for opening a job's events."
    )
    redis_max_connections: int = Field(
        6,
        ge=1,
        description="Pooled Redis connections of one gateway for its requests; commands beyond wait for "
        "one. Open SSE streams hold none (see relay_connections).",
    )
    relay_connections: int = Field(
        1,
        ge=1,
        description="Redis connections that read the open event streams of one gateway, whatever their "
        "number (each read covers just the streams that changed); one more holds the subscription "
        "that says which changed.",
    )
    submit_replicas: int = Field(
        0,
        ge=0,
        description="Replicas that must confirm a submission's writes (Redis WAIT) before it gets its 202; "
        "fewer within submit_replicas_timeout_ms gets 503 not_replicated. 0 does not wait.",
    )
    submit_replicas_timeout_ms: int = Field(
        1000, ge=1, description="Longest wait, in milliseconds, for submit_replicas to confirm a submission."
    )
    relay_buffer_events: int = Field(
        256,
        ge=1,
        description="Events buffered for one stream behind an ASGI server other than the gateway's own; a "
        "client further behind reads on from Redis once it catches up, without holding up the others "
        "(behind the gateway's own server, streams are bounded by their connection's write buffer instead).",
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
        description="Engine batch rows (requests generated together); default 8 on ortfleet's batcher, "
        "else from genai_config (og.Engine's static scheduler's default is 4).",
    )
    scheduler: Literal["auto", "batcher", "og-engine"] = Field(
        "auto",
        description="What batches the requests: batcher (ortfleet's continuous batcher: requests join "
        "and leave at every step, chunked prefill; CPU only), og-engine (ORT-GenAI's og.Engine: dynamic "
        "batching where the model has paged attention, else its static scheduler) or auto (og.Engine "
        "where the model has paged attention or the device is a GPU, the batcher elsewhere).",
    )
    kv_budget_tokens: int | None = Field(
        None,
        ge=1,
        description="On the batcher: tokens of KV cache the running requests may hold together (each "
        "reserves its prompt plus max_tokens when it starts; requests wait for room). Default: batch "
        "rows x the model's context. A token costs 2 x layers x KV heads x head size x 4 bytes "
        "(46 KB on the default model).",
    )
    prefill_chunk_tokens: int = Field(
        128,
        ge=16,
        le=8192,
        description="On the batcher: the most prompt tokens prefilled between two decode steps; a "
        "longer prompt is prefilled a chunk at a time, so the running requests keep generating (one "
        "token per chunk while it prefills). Prompt prefixes are reused in whole chunks. Larger: long "
        "prompts prefill a little faster; smaller: running requests stall less.",
    )
    prefix_cache: bool = Field(
        True,
        description="On the batcher: a finished request's prompt KV stays in its free slot, and a request "
        "whose prompt starts the same way (whole prefill chunks) prefills only the rest; its tokens are "
        "the same as without the cache.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Worker deaths a job may cause in quarantine (running alone on its worker, after a "
        "first death made it suspect) before it fails as poison; stopped or drained workers never count.",
    )
    resume_mode: Literal["replay", "prefill"] = Field(
        "replay",
        description="How a job resumes from the tokens already streamed: replay (recompute them one "
        "decode step each, as first computed: greedy text equals an uninterrupted run's) or prefill "
        "(one prefill of prompt and tokens: faster, but the text may differ after the resume point).",
    )
    crash_marker: str = Field(
        "",
        description="Testing aid: a worker kills itself (SIGKILL) when it starts a job whose prompt "
        "holds this text, as an engine crash would (a poison job); empty is off.",
    )
    fail_marker: str = Field(
        "",
        description="Testing aid: a worker fails a job whose prompt holds this text with error code "
        "job_failed, as it fails a job its engine could not run; empty is off.",
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
        "starts a batch with fewer; otherwise, for jobs submitted together with the first, until a tenth "
        "of it has passed since that one's submission; 0 starts at once.",
    )
    publish_max_batch: int = Field(
        64, ge=1, description="Most tokens written to a job's stream in one Redis round trip."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="A job's tokens go to its stream this many at a time (its first token, and what is "
        "left when it ends, at once). 1 streams every engine step's tokens as they come; more cuts the "
        "fleet's CPU per token (Redis writes, relay reads and client writes per step) and makes streams "
        "burstier: a client gets n tokens every n steps.",
    )
    preempt_batch: bool = Field(
        True,
        description="Batch jobs yield to interactive ones: when interactive jobs wait and no slot is free, "
        "a worker sends batch jobs back to the queue (they resume later from their streamed tokens; "
        "not an attempt). On the static scheduler this cuts the whole batch.",
    )
    preempt_after_s: float = Field(
        0.01,
        ge=0,
        le=60,
        description="How long interactive jobs wait (for a worker with a free slot) before a worker full "
        "of batch jobs preempts them.",
    )
    preempt_for_keys: bool = Field(
        True,
        description="Keys share a worker's slots: when another key's interactive job has waited "
        "ORTFLEET_PREEMPT_FOR_KEYS_AFTER_S at the head of the queue and no slot is free, a worker on "
        "continuous batching sends back the latest-started interactive job of the key that holds the "
        "most of its slots (at least two more than the waiting job's key). It resumes later from its "
        "streamed tokens, behind the job it made room for (not an attempt).",
    )
    preempt_for_keys_after_s: float = Field(
        1.0,
        ge=0,
        le=600,
        description="How long another key's interactive job waits at the head of the queue before a "
        "worker preempts for it (ORTFLEET_PREEMPT_FOR_KEYS); a preempted job prefills its prompt again.",
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
            shown[name] = _masked(value)
        elif isinstance(value, dict):
            shown[name] = {k: _masked(v) if isinstance(v, SecretStr) else v for k, v in value.items()}
        elif isinstance(value, Path):
            shown[name] = str(value)
        else:
            shown[name] = value
    return shown


def _masked(value: SecretStr) -> str:
    raw = value.get_secret_value()
    return mask_url(raw) if "://" in raw else ("**********" if raw else "")
