"""Turning a validated job request into a queued job: model resolution, limits, placement over a model's
stores (its Idempotency-Key's part in gateway/idempotency.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.apikeys import ANONYMOUS, Principal
from common.error_codes import ErrorCode
from common.guidance import Guidance
from common.jobs.submission import (
    EpochChanged,
    NotReplicated,
    OwnerBusy,
    PromptTokensBusy,
    QueueFull,
    QueueLimits,
    StreamBytesBusy,
    Submitted,
)
from common.prefix_hints import preferred_worker
from common.store_epoch import new_job_id
from common.wire import PRIORITY_ORDER, JobRequest, JobSpec, PriorityClass, Sampling
from gateway import guidance_check
from gateway.cache_scope import cache_scope
from gateway.errors import ApiError, store_full, validation_error
from gateway.fleet import FleetSnapshot
from gateway.idempotency import (
    KeyTries,
    check_same_request,
    idempotency_digest,
    idempotent_job,
    key_tries,
    note_try,
    one_try_at_a_time,
    request_digest,
)
from gateway.placement import share_of_limit
from gateway.shards import Shard
from gateway.state import AppState
from gateway.stream_cost import estimated_stream_bytes


@dataclass(frozen=True)
class ServedModel:
    """What a request's `model` names: a served model, or one of its LoRA adapters."""

    model: str  # the served model, whose queue and workers take the request's jobs
    context_length: int
    adapter: str | None = None  # the adapter its workers run the jobs with (None: the model itself)

    @property
    def name(self) -> str:
        """The name the request gave, which its answers carry."""
        return self.adapter or self.model


async def resolve_model(state: AppState, requested: str | None) -> ServedModel:
    """The served model (or LoRA adapter) a request names; 404/422/503 when it cannot be served now (503
    store_full first, while its stores refuse writes for memory, which their workers' heartbeats meet too).
    An adapter's name resolves to its model: its jobs go to the model's queue, the adapter named in each.
    A name the snapshot does not know is looked up once in a fresh read of the registry."""
    fleet = await state.fleet.snapshot()
    fresh = False
    if requested is not None and requested not in fleet.known and requested not in fleet.adapters:
        fleet, fresh = await state.fleet.snapshot(fresh=True), True
    if requested is not None and requested not in fleet.known and requested in fleet.adapters:
        served = await _resolve_model(state, fleet.adapters[requested], fleet, fresh)
        return ServedModel(served.model, served.context_length, requested)
    return await _resolve_model(state, requested, fleet, fresh)


async def _resolve_model(
    state: AppState, requested: str | None, fleet: FleetSnapshot, fresh: bool
) -> ServedModel:
    """`fleet`: the snapshot read so far, `fresh` when it began after the request came (not read again)."""
    if (full := state.shards.full(requested)) is not None:
        raise store_full(full)

    async def read_again() -> FleetSnapshot:
        nonlocal fresh
        if fresh:
            return fleet
        fresh = True
        return await state.fleet.snapshot(fresh=True)

    if requested is None:
        if len(fleet.live) != 1:  # the snapshot may predate a worker that just came or went
            fleet = await read_again()
        if len(fleet.live) == 1:
            name = next(iter(fleet.live))
            return ServedModel(name, fleet.live[name].context_length)
        names = sorted(fleet.live) or sorted(fleet.known)
        if not names:
            message = "no worker is serving any model yet"
            raise ApiError(503, message, param="model", code=ErrorCode.no_live_worker)
        raise ApiError(422, f"model: required, this fleet serves {', '.join(names)}", param="model")
    if requested not in fleet.known:
        fleet = await read_again()
    if requested not in fleet.known:
        served = ", ".join(sorted(fleet.known)) or "none"
        raise ApiError(
            404,
            f"model {requested!r} does not exist (served: {served})",
            param="model",
            code=ErrorCode.model_not_found,
        )
    if requested not in fleet.live:
        fleet = await read_again()
    if requested not in fleet.live and state.settings.queue_without_workers:
        return ServedModel(requested, fleet.known[requested])  # it waits for a worker (scaled to zero)
    if requested not in fleet.live:
        raise no_live_worker(requested)
    return ServedModel(requested, fleet.live[requested].context_length)


def check_length(request: JobRequest, context_length: int) -> None:
    max_tokens = request.max_tokens
    if max_tokens is not None and max_tokens >= context_length:
        raise ApiError(
            422,
            f"max_tokens: {max_tokens} does not fit the model's context of {context_length} tokens "
            "(prompt and generated tokens together)",
            param="max_tokens",
            code=ErrorCode.context_length_exceeded,
        )


def resolved_sampling(request: JobRequest, default_max_tokens: int) -> Sampling:
    """The request's sampling with the gateway's default max_tokens filled in (and checked again)."""
    fields = request.model_dump(include=set(Sampling.model_fields))
    fields["max_tokens"] = request.max_tokens or default_max_tokens
    try:
        return Sampling.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from e


async def guidance_of(request: JobRequest) -> Guidance | None:
    """The grammar for the request's response_format, checked as the engine would compile and run it
    (400 naming the limit it exceeds); ignore_eos cannot go with one (the grammar ends)."""
    guidance = request.response_format.guidance() if request.response_format is not None else None
    if guidance is None:
        return None
    if request.ignore_eos:
        raise ApiError(
            422,
            "ignore_eos: cannot be combined with structured output, whose grammar decides where it ends",
            param="ignore_eos",
        )
    problem = await asyncio.to_thread(guidance_check.check, guidance)
    if problem is not None:
        raise ApiError(
            400,
            f"response_format: {problem.message}",
            param="response_format",
            code=ErrorCode.invalid_response_format,
        )
    return guidance


def queue_limits(state: AppState) -> QueueLimits:
    settings = state.settings
    return QueueLimits(settings.max_queued_jobs, settings.max_queued_tokens, settings.queue_timeout_s)


def estimated_prompt_tokens(spec: JobSpec, context_length: int) -> int:
    """A job's prompt in tokens, as the gateway (which has no tokenizer) estimates it: about 4 characters
    a token, each chat message with a few more for its template, and never past the model's context (a
    longer prompt fails when its worker tokenizes it)."""
    if spec.messages is not None:
        prompt_chars = sum(len(m.content) + 16 for m in spec.messages)
    else:
        prompt_chars = len(spec.prompt or "")
    return min(prompt_chars // 4 + 1, max(context_length, 1))


async def kv_tokens_needed(state: AppState, spec: JobSpec, context_length: int) -> int:
    """The KV tokens the job needs on its worker (prompt and max_tokens, at most the context), as the
    gateway estimates them, and never more than the largest budget of the model's live workers (a worker
    with a smaller one leaves the job to a larger, claim.lua). 422 naming max_tokens when no live worker
    could hold even its max_tokens and one prompt token."""
    max_tokens = spec.sampling.max_tokens or context_length
    least = min(context_length, max_tokens + 1)
    live = (await state.fleet.snapshot()).live.get(spec.model)
    if live is not None and 0 < live.kv_budget_tokens < least:  # a refusal reads the registry afresh:
        live = (await state.fleet.snapshot(fresh=True)).live.get(spec.model)  # a worker may have just come
    if live is None or live.kv_budget_tokens <= 0:  # no worker yet (ORTFLEET_QUEUE_WITHOUT_WORKERS)
        return least
    largest = live.kv_budget_tokens
    if least > largest:
        raise ApiError(
            422,
            f"max_tokens: {max_tokens} with its prompt needs at least {least} tokens of KV cache, and the "
            f"live workers of model {spec.model!r} hold at most {largest} for a job "
            "(their ORTFLEET_KV_BUDGET_TOKENS); ask for fewer tokens",
            param="max_tokens",
            code=ErrorCode.context_length_exceeded,
        )
    return min(context_length, estimated_prompt_tokens(spec, context_length) + max_tokens, largest)


def estimated_cost(spec: JobSpec, context_length: int) -> int:
    """Tokens a job will occupy: its prompt plus what it may generate."""
    return estimated_prompt_tokens(spec, context_length) + (spec.sampling.max_tokens or 0)


def check_priority(requested: PriorityClass, principal: Principal) -> None:
    """403 when the key may not submit jobs of this class (its ceiling is lower)."""
    ceiling = PriorityClass(principal.max_class)
    if PRIORITY_ORDER.index(requested) < PRIORITY_ORDER.index(ceiling):
        raise ApiError(
            403,
            f"priority: key {principal.name!r} may submit {ceiling.value} jobs at most, "
            f"not {requested.value}",
            param="priority",
            code=ErrorCode.priority_not_allowed,
        )


@dataclass(frozen=True)
class SubmittedJob(Submitted):
    model: str = ""  # as the request named it: an adapter's name, when it named one
    created_at: float = 0.0


async def submit_job(
    state: AppState,
    request: JobRequest,
    idempotency_key: str | None,
    principal: Principal = ANONYMOUS,
    priority: PriorityClass | None = None,
    store: Shard | None = None,
) -> SubmittedJob:
    """Queue the job for `principal`, who owns it; idempotency keys are per owner. `priority` (a batch
    line's) overrides the request's class. `store`: the store of its model it must go to (where the other
    choices of its request went), else the one placement picks."""
    effective = priority or request.priority
    check_priority(effective, principal)
    guidance = await guidance_of(request)
    served = await resolve_model(state, request.model)
    model, context_length = served.model, served.context_length
    check_length(request, context_length)
    now = time.time()
    idem = idempotency_digest(principal, idempotency_key) if idempotency_key else None
    digest = request_digest(request, effective) if idem else None
    spec = JobSpec(
        id="",  # it carries the epoch of the store that takes it
        model=model,
        prompt=request.prompt,
        messages=request.messages,
        sampling=resolved_sampling(request, state.settings.default_max_tokens),
        submitted_at=now,
        priority=effective,
        guidance=guidance,
        cache_scope=cache_scope(state.settings, principal.name, request.cache_salt),
        adapter=served.adapter,
    )
    every = state.shards.stores_of(model)
    snapshot = await state.fleet.snapshot()
    keep_idle = state.settings.queue_without_workers
    stores = [store] if store else state.placement.order(every, model, snapshot, idem, keep_idle=keep_idle)
    counted = stores[0] if store is None and len(stores) > 1 else None
    tries = key_tries(every, idem)
    taken_by: Shard | None = None
    try:
        async with one_try_at_a_time(state, tries, len(every)):
            if tries is not None and (existing := await idempotent_job(state.shards, every, tries)):
                submitted = Submitted(existing, created=False)
            else:
                submitted, taken_by = await _place(
                    state, stores, len(every), spec, context_length, idem, principal, digest, tries
                )
    finally:
        if counted is not None:  # placement counted the job on its first store: where did it go?
            state.placement.moved(counted, taken_by, model)
    if submitted.created:
        state.metrics.jobs_submitted.labels(model).inc()
    else:
        await check_same_request(state, submitted.job_id, digest, idempotency_key or "")
    return SubmittedJob(submitted.job_id, submitted.created, served.name, now)


async def _place(
    state: AppState,
    stores: list[Shard],
    of_model: int,
    spec: JobSpec,
    context_length: int,
    idem: str | None,
    principal: Principal,
    digest: str | None,
    tries: KeyTries | None,
) -> tuple[Submitted, Shard]:
    """Submits the job to the first of `stores` (in placement order, those whose worker holds the chat's
    prefix first) that takes it, each given its share of the key's limits (the model has `of_model`
    stores), and says which took it; the first refusal when none does. `tries`: its Idempotency-Key's over
    the stores; the key's home store lists every other store the job is sent to before it goes there."""
    routes = await _routes(state, stores, spec, now=spec.submitted_at)
    refusals: list[_Refusal] = []
    for store, route in sorted(zip(stores, routes, strict=True), key=lambda pair: pair[1][0] is None):
        if (full := store.watch.full) is not None:  # it would take the job, then fail to run it
            refusals.append(store_full(full))
            continue
        if tries is not None and store is not tries.home:
            try:
                await note_try(tries, store, state.settings.job_ttl_s)
            except RedisError as e:  # unlisted, a retry could miss the job there: not sent
                refusals.append(e)
                break
        try:
            submitted = await _submit_to(
                state, store, of_model, spec, context_length, idem, principal, digest, route
            )
        except _FALLS_OVER as e:  # another store may have room
            refusals.append(e)
            continue
        except (NotReplicated, EpochChanged) as e:
            raise _refused(e) from e
        except OutOfMemoryError:
            store.watch.note_refused()  # the next submissions hear of it before its memory is read
            raise
        except (RedisConnectionError, RedisTimeoutError) as e:
            state.placement.unreachable(store)
            if idem is not None:  # a retry with the key must find the job where this try went
                raise
            refusals.append(e)  # the next store takes it, as a client's retry would
            continue
        return submitted, store
    raise _first_refusal(refusals, principal, of_model)


# Refusals of one store that another store of the model may not give: each store counts its own jobs.
_FALLS_OVER = (OwnerBusy, PromptTokensBusy, StreamBytesBusy, QueueFull)
_Refusal = ApiError | RedisError | OwnerBusy | PromptTokensBusy | StreamBytesBusy | QueueFull


async def _submit_to(
    state: AppState,
    store: Shard,
    stores: int,
    spec: JobSpec,
    context_length: int,
    idem: str | None,
    principal: Principal,
    digest: str | None,
    route: tuple[str | None, int | None],
) -> Submitted:
    """Submits the job to one of its model's `stores` stores, its id carrying that Redis's epoch; a key's
    limits are shared out over the stores (share_of_limit)."""
    kv_tokens = await kv_tokens_needed(state, spec, context_length)
    prompt_tokens = estimated_prompt_tokens(spec, context_length)

    async def submit(epoch: str) -> Submitted:
        job = spec.model_copy(update={"id": new_job_id(epoch)})
        return await store.queue.submit(
            job,
            limits=queue_limits(state),
            cost=estimated_cost(job, context_length),
            kv_tokens=kv_tokens,
            idempotency_key=store.keys.idempotency(idem) if idem else None,
            owner=principal.name,
            owner_max_active=share_of_limit(principal.max_concurrent_jobs or 0, stores),
            weight=principal.weight,
            prompt_tokens=prompt_tokens,
            owner_max_prompt_tokens=share_of_limit(principal.max_prompt_tokens_in_flight or 0, stores),
            stream_bytes=estimated_stream_bytes(job, prompt_tokens),
            owner_max_stream_bytes=share_of_limit(
                state.settings.key_max_stream_bytes_in_flight if principal.name else 0, stores
            ),
            request_digest=digest,
            replicas=state.settings.submit_replicas,
            replicas_timeout_ms=state.settings.submit_replicas_timeout_ms,
            epoch=epoch,
            preferred_worker=route[0],
            preferred_until_ms=route[1],
        )

    try:
        return await submit(store.watch.epoch or await store.watch.check_epoch())
    except EpochChanged:  # the Redis lost its data since its epoch was read: note it, then go on
        return await submit(await store.watch.check_epoch())


def _first_refusal(refusals: list[_Refusal], principal: Principal, of_model: int) -> Exception:
    """The answer when every store of the model refused the job: the first store's refusal (a Redis
    error as it came, for the gateway's handler), the key's whole limit named where it is one of the key's
    limits."""
    first = refusals[0]
    if isinstance(first, ApiError | RedisError):
        return first
    if isinstance(first, OwnerBusy) and of_model > 1:
        first = OwnerBusy(first.owner, principal.max_concurrent_jobs or first.limit, of_model)
    return _refused(first)


def _refused(
    e: NotReplicated | EpochChanged | OwnerBusy | PromptTokensBusy | StreamBytesBusy | QueueFull,
) -> ApiError:
    """The answer to the queue's refusal of a job: each passes, so the client may retry in a second."""
    match e:
        case NotReplicated():
            status, code = 503, ErrorCode.not_replicated
            message = (
                f"{e}, fewer than the {e.wanted} required: the job may exist but could be lost if the Redis "
                "primary fails now; retry with the same Idempotency-Key, which returns this job if it exists"
            )
        case EpochChanged():  # the Redis lost its data again, at once
            status, code, message = 503, ErrorCode.store_lost, f"{e}; retry shortly"
        case OwnerBusy():
            status, code, message = 429, ErrorCode.too_many_active_jobs, str(e)
        case PromptTokensBusy():
            status, code = 429, ErrorCode.too_many_prompt_tokens
            message = f"{e} (ORTFLEET_KEY_MAX_PROMPT_TOKENS_IN_FLIGHT)"
        case StreamBytesBusy():
            status, code = 429, ErrorCode.too_many_stream_bytes
            message = f"{e} (ORTFLEET_KEY_MAX_STREAM_BYTES_IN_FLIGHT)"
        case QueueFull():
            status, code, message = 429, ErrorCode.queue_full, str(e)
    return ApiError(status, message, code=code, headers={"Retry-After": "1"})


async def _routes(
    state: AppState, stores: list[Shard], spec: JobSpec, now: float
) -> list[tuple[str | None, int | None]]:
    """For each store, the worker there that holds the KV of the chat's leading messages, and until when
    the job waits for it (common/prefix_hints.py), left by a job of its cache scope; none for a prompt,
    or with routing off."""
    wait_s = state.settings.prefix_route_wait_s
    if not spec.messages or wait_s <= 0:
        return [(None, None)] * len(stores)
    workers = await asyncio.gather(
        *(
            preferred_worker(store.redis, store.keys, spec.model, spec.cache_scope, spec.messages)
            for store in stores
        ),
        return_exceptions=len(stores) > 1,  # a store that cannot be read has no hint: the others serve
    )
    return [
        (worker, int((now + wait_s) * 1000)) if isinstance(worker, str) else (None, None)
        for worker in workers
    ]


def no_live_worker(model: str, purpose: str = "") -> ApiError:
    """503 with a retry: no live worker serves `model` (`purpose`: for what, as " to load ...")."""
    return ApiError(
        503,
        f"no live worker serves model {model!r}{purpose}",
        param="model",
        code=ErrorCode.no_live_worker,
        headers={"Retry-After": "5"},
    )
