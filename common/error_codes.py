"""Every error code ortfleet gives programs: in the error envelope, a job's record and its error event."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    # A job's own failure: its record's error_code and its stream's error event.
    context_length_exceeded = "context_length_exceeded"
    expired_in_queue = "expired_in_queue"
    job_failed = "job_failed"
    invalid_response_format = "invalid_response_format"  # the engine cannot compile the grammar
    max_tokens_too_small = "max_tokens_too_small"  # no document of its response format fits max_tokens
    structured_output_not_resumable = "structured_output_not_resumable"
    poison = "poison"  # its workers died running it alone, in quarantine, ORTFLEET_MAX_ATTEMPTS times
    # Requests the gateway refuses.
    invalid_api_key = "invalid_api_key"
    rate_limit_exceeded = "rate_limit_exceeded"
    too_many_active_jobs = "too_many_active_jobs"
    too_many_prompt_tokens = "too_many_prompt_tokens"  # the key's queued and running prompts hold its limit
    too_many_stream_bytes = "too_many_stream_bytes"  # the key's active jobs' streams would keep too much
    tokenize_rate_exceeded = "tokenize_rate_exceeded"  # the key tokenized its characters per second
    queue_full = "queue_full"
    model_not_found = "model_not_found"
    no_live_worker = "no_live_worker"
    job_not_found = "job_not_found"
    file_not_found = "file_not_found"
    file_in_use = "file_in_use"  # a batch that has not ended reads it
    file_quota_exceeded = "file_quota_exceeded"  # the key keeps its most bytes or files of files
    batch_not_found = "batch_not_found"
    response_not_found = "response_not_found"
    priority_not_allowed = "priority_not_allowed"
    unsupported_parameter = "unsupported_parameter"
    unsupported_value = "unsupported_value"
    store_unavailable = "store_unavailable"
    worker_timeout = "worker_timeout"  # no worker answered a tokenizer (or adapter) call in time
    # LoRA adapters loaded and unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)
    runtime_lora_updating_disabled = "runtime_lora_updating_disabled"  # ORTFLEET_ALLOW_RUNTIME_LORA_UPDATING
    admin_key_required = "admin_key_required"  # a client's key on an operator's route
    adapter_exists = "adapter_exists"  # the name is served already (an adapter's or a model's)
    adapter_not_found = "adapter_not_found"
    adapter_refused = "adapter_refused"  # a worker could not load it (a mismatch, unreadable): none keeps it
    stream_tokens_disabled = "stream_tokens_disabled"
    store_timeout = "store_timeout"
    not_replicated = "not_replicated"  # fewer replicas than ORTFLEET_SUBMIT_REPLICAS confirmed a submission
    store_full = "store_full"  # Redis refuses writes for memory (maxmemory reached, noeviction)
    server_shutting_down = (
        "server_shutting_down"  # the gateway stopped while an OpenAI call waited or streamed
    )
    store_lost = "store_lost"  # Redis lost its data (restarted without persistence): the job or file is gone
    # refused by a protective limit
    invalid_json = "invalid_json"
    invalid_text = "invalid_text"
    json_too_deep = "json_too_deep"
    number_too_long = "number_too_long"
    number_out_of_range = "number_out_of_range"
    too_many_streams = "too_many_streams"
    too_many_choices = "too_many_choices"
    # a job ended by its content or by a purge
    invalid_prompt = "invalid_prompt"
    job_purged = "job_purged"
    idempotency_key_reused = "idempotency_key_reused"
    idempotency_key_in_use = "idempotency_key_in_use"
