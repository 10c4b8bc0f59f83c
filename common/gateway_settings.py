"""The gateway's settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from common.apikeys import check_name
from common.settings import FleetSettings


class GatewaySettings(FleetSettings):
    """Settings of the HTTP gateway."""

    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on.")
    reuse_port: bool = Field(
        False,
        description="Listen with SO_REUSEPORT, so several gateway processes on one host share the port "
        "and the kernel spreads connections over them (`ortfleet up --gateways N` sets it). Off, a port "
        "another process holds stops the gateway at start.",
    )
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
    store_outage_limit_s: float = Field(
        60.0,
        gt=0,
        description="How long a reader of a job's tokens waits for a Redis that does not answer before it "
        "gives up: event streams then end with an `error` event (code store_unavailable; OpenAI streams "
        "with an error chunk and `data: [DONE]`), and OpenAI calls, Responses and long-polls that wait for "
        "a job answer 503 store_unavailable. Redis back within it: every reader goes on, losing nothing.",
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
    prefix_cache_groups: list[list[str]] = Field(
        default_factory=list,
        description="Groups of API key names whose requests reuse each other's cached prompt prefixes, as "
        'JSON: [["alice", "bob"], ["carol", "dave"]]. A key is in one group at most; a key in none reuses '
        "only its own. Give every gateway the same groups.",
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
    admin_api_key: SecretStr | None = Field(
        None,
        description="The operators' key: loading and unloading LoRA adapters at run time "
        "(`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`) needs `Authorization: Bearer` this key "
        "once it is set or API keys are on; a client's key gets 403.",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Serve `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's, as its "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): an operator loads a LoRA adapter into every live worker of a "
        "model, read from a folder on the workers' hosts, without a restart. Off, they answer 404.",
    )
    lora_update_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for every live worker of a model to load (or unload) a LoRA adapter at "
        "run time; a load not done by all in time is undone on every worker and answered 504.",
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
    key_max_stream_bytes_in_flight: int = Field(
        256 * 2**20,
        ge=0,
        description="Bytes the token streams of a key's active (queued or running) jobs may keep in Redis "
        "in all, estimated at submission from max_tokens and logprobs (about 64 bytes a token, 2 KB a token "
        "with 20 top logprobs; see docs/api.md); a job that would pass it gets 429 too_many_stream_bytes, "
        "unless the key has nothing in flight; a gateway without keys has none. 0: no limit.",
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
        ge=1,
        description="Seconds an uploaded file, and a batch's output and error files, are kept.",
    )
    key_max_stored_file_bytes: int = Field(
        2**30,
        ge=0,
        description="Bytes of files (uploads, and batches' output and error files) one API key may keep "
        "in Redis at once, counted until each is deleted or expires; an upload that would pass it gets "
        "400 file_quota_exceeded before its bytes are stored. Keep the keys' sum under Redis's maxmemory. "
        "0: no limit.",
    )
    key_max_stored_files: int = Field(
        10_000,
        ge=0,
        description="Files one API key may keep at once (as key_max_stored_file_bytes counts them; one "
        "page of `GET /v1/files` lists them all); one more upload gets 400 file_quota_exceeded. 0: no "
        "limit.",
    )
    files_max_memory_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The share of its Redis's maxmemory that files may fill it to, whoever uploads them: an "
        "upload that would take the Redis's used memory past it gets 400 file_quota_exceeded, so that the "
        "rest is left to jobs. 1: files may fill it (a full Redis then answers every caller 503 "
        "store_full). No effect on a Redis without maxmemory, or whose INFO is disabled.",
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

    @field_validator("prefix_cache_groups")
    @classmethod
    def _one_group_per_key(cls, groups: list[list[str]]) -> list[list[str]]:
        seen: set[str] = set()
        for group in groups:
            for name in group:
                check_name(name)  # an ApiKeyError, a ValueError: pydantic reports it
                if name in seen:
                    raise ValueError(f"key {name!r} is in more than one group")
                seen.add(name)
        return groups
