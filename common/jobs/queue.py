"""JobQueue: the job state machine's one entry point, its methods grouped by concept in the modules of
common/jobs/."""

from __future__ import annotations

from redis.asyncio import Redis

from common.jobs.cancellation import CancelScript, ExpireQueuedScript, JobCancellation, PurgeScript
from common.jobs.claims import ClaimScript, JobLeasing, ReleaseScript, RenewScript, ReservePreemptionScript
from common.jobs.reads import JobReads
from common.jobs.submission import JobSubmission, SubmitScript
from common.jobs.writes import FinishScript, JobWrites, PublishScript, PublishStepScript
from common.keys import Keyspace


class JobQueue(JobReads, JobSubmission, JobCancellation, JobLeasing, JobWrites):
    """Atomic job transitions shared by the gateway (submit, cancel, purge) and workers (claim ... finish).

    Its Redis client is its own: callers read and change jobs through its methods only.
    """

    def __init__(self, redis: Redis, ttl_s: int, keys: Keyspace) -> None:
        self._redis = redis
        self.keys = keys  # the store's keyspace: every key it names
        self.ttl_s = ttl_s
        self._submit = SubmitScript(redis, keys)
        self._cancel = CancelScript(redis, keys)
        self._purge = PurgeScript(redis, keys)
        self._expire_queued = ExpireQueuedScript(redis, keys)
        self._claim = ClaimScript(redis, keys)
        self._renew = RenewScript(redis, keys)
        self._release = ReleaseScript(redis, keys)
        self._reserve_preemption = ReservePreemptionScript(redis, keys)
        self._publish = PublishScript(redis, keys)
        self._publish_step = PublishStepScript(
            redis, keys
        )  # one script call per engine step, one after another
        self._finish = FinishScript(redis, keys)
