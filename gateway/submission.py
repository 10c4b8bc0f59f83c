"""Turning a validated job request into a queued job: model resolution, limits, idempotency."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from pydantic import ValidationError

from common import keys
from common.apikeys import ANONYMOUS, Principal
from common.jobqueue import OwnerBusy, QueueFull, QueueLimits, Submitted
from common.wire import JobRequest, JobSpec, JobStatus, Sampling
from gateway.errors import ApiError, validation_error
from gateway.state import AppState


def new_job_id() -> str:
    return "job_" + secrets.token_urlsafe(18)


async def resolve_model(state: AppState, requested: str | None) -> tuple[str, int]:
    """The served model name and its context length; 404/422/503 when it cannot be served now."""
    fleet = await state.fleet.snapshot()
    if requested is None:
        if len(fleet.live) == 1:
            name = next(iter(fleet.live))
            return name, fleet.live[name].context_length
        names = sorted(fleet.live) or sorted(fleet.known)
        if not names:
            raise ApiError(503, "no worker is serving any model yet", param="model", code="no_live_worker")
        raise ApiError(422, f"model: required, this fleet serves {', '.join(names)}", param="model")
    if requested not in fleet.known:
        fleet = await state.fleet.snapshot(fresh=True)
    if requested not in fleet.known:
        served = ", ".join(sorted(fleet.known)) or "none"
        raise ApiError(
            404,
            f"model {requested!r} does not exist (served: {served})",
            param="model",
            code="model_not_found",
        )
    if requested not in fleet.live:
        fleet = await state.fleet.snapshot(fresh=True)
    if requested not in fleet.live:
        raise ApiError(
            503,
            f"no live worker serves model {requested!r}",
            param="model",
            code="no_live_worker",
            headers={"Retry-After": "5"},
        )
    return requested, fleet.live[requested].context_length


def check_length(request: JobRequest, context_length: int) -> None:
    max_tokens = request.max_tokens
    if max_tokens is not None and max_tokens >= context_length:
        raise ApiError(
            422,
            f"max_tokens: {max_tokens} does not fit the model's context of {context_length} tokens "
            "(prompt and generated tokens together)",
            param="max_tokens",
            code="context_length_exceeded",
        )


def resolved_sampling(request: JobRequest, default_max_tokens: int) -> Sampling:
    """The request's sampling with the gateway's default max_tokens filled in (and checked again)."""
    fields = request.model_dump(include=set(Sampling.model_fields))
    fields["max_tokens"] = request.max_tokens or default_max_tokens
    try:
        return Sampling.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from e


def queue_limits(state: AppState) -> QueueLimits:
    settings = state.settings
    return QueueLimits(settings.max_queued_jobs, settings.max_queued_tokens, settings.queue_timeout_s)


def estimated_cost(spec: JobSpec) -> int:
    """Tokens a job will occupy: its prompt (about 4 characters a token) plus what it may generate."""
    if spec.messages is not None:
        prompt_chars = sum(len(m.content) + 16 for m in spec.messages)
    else:
        prompt_chars = len(spec.prompt or "")
    return prompt_chars // 4 + 1 + (spec.sampling.max_tokens or 0)


@dataclass(frozen=True)
class SubmittedJob(Submitted):
    model: str = ""
    created_at: float = 0.0


async def submit_job(
    state: AppState, request: JobRequest, idempotency_key: str | None, principal: Principal = ANONYMOUS
) -> SubmittedJob:
    """Queue the job for `principal`, who owns it; idempotency keys are per owner."""
    model, context_length = await resolve_model(state, request.model)
    check_length(request, context_length)
    now = time.time()
    spec = JobSpec(
        id=new_job_id(),
        model=model,
        prompt=request.prompt,
        messages=request.messages,
        sampling=resolved_sampling(request, state.settings.default_max_tokens),
        submitted_at=now,
    )
    record = {
        "id": spec.id,
        "model": model,
        "status": JobStatus.queued.value,
        "created_at": str(now),
        "attempts": "0",
    }
    idem = None
    if idempotency_key:
        scoped = f"{principal.name}\n{idempotency_key}"
        idem = keys.idempotency(hashlib.sha256(scoped.encode()).hexdigest())
    try:
        submitted = await state.queue.submit(
            spec,
            record,
            limits=queue_limits(state),
            cost=estimated_cost(spec),
            idempotency_key=idem,
            owner=principal.name,
            owner_max_active=principal.max_concurrent_jobs or 0,
        )
    except OwnerBusy as e:
        raise ApiError(429, str(e), code="too_many_active_jobs", headers={"Retry-After": "1"}) from e
    except QueueFull as e:
        raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
    if submitted.created:
        state.metrics.jobs_submitted.labels(model).inc()
    return SubmittedJob(submitted.job_id, submitted.created, model, now)
