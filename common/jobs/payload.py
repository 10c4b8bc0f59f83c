"""A job as stored for its workers: arq's job format (``arq:job:<id>``, JSON-serialized)."""

from __future__ import annotations

import json
from typing import Any

from arq.jobs import deserialize_job_raw, serialize_job

from common.wire import JobSpec

GENERATE = "generate"


class MalformedJob(ValueError):
    """A job found in Redis that is not one ortfleet wrote (truncated, foreign or pickled)."""


def job_payload(spec: JobSpec, enqueue_ms: int) -> bytes:
    payload: bytes = serialize_job(
        GENERATE, (), {"spec": spec.model_dump(mode="json")}, None, enqueue_ms, serializer=_json_bytes
    )
    return payload


def _json_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def parse_job_payload(payload: str) -> JobSpec:
    try:
        function, _args, kwargs, _tries, _enqueued = deserialize_job_raw(
            payload.encode(), deserializer=json.loads
        )
        if function != GENERATE:
            raise ValueError(f"unknown job function {function!r}")
        return JobSpec.model_validate(kwargs["spec"])
    except Exception as e:
        raise MalformedJob(f"malformed job payload: {e}") from e
