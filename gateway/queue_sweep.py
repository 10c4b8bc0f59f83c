"""The gateways' sweep of queue deadlines: a job still waiting for its first attempt past
ORTFLEET_QUEUE_TIMEOUT_S fails as expired in the queue on time, whether or not a worker of its model
is live to reach it (a claim fails it too, by the same script code). Every gateway sweeps; the script
is atomic, so a job expires once."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from common.jobs.queue import JobQueue

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 0.5
SWEEP_MOST = 100  # jobs a sweep looks at; a full one is followed by another at once


async def sweep_queue_deadlines(queue: JobQueue, label: str) -> None:
    """Sweeps the deadlines of the jobs on one Redis (`label`) until cancelled."""
    while True:
        expired = 0
        try:
            expired = await queue.expire_overdue(int(time.time() * 1000), SWEEP_MOST)
        except (RedisError, OSError) as e:  # Redis away: the next sweep tries again
            logger.debug("sweeping the queue deadlines on %s failed (%s)", label, e)
        except Exception:  # a fault of this process: said, and the sweep goes on rather than stop for good
            logger.exception("sweeping the queue deadlines on %s failed", label)
        if expired:
            logger.info("%d job(s) on %s expired in the queue (ORTFLEET_QUEUE_TIMEOUT_S)", expired, label)
        await asyncio.sleep(0 if expired >= SWEEP_MOST else SWEEP_EVERY_S)
