-- A job's data lives until the job has ended plus the job TTL: while it is queued or running nothing of
-- it expires (submit.lua sets no expiry), and the script of the transition that ends it calls
-- keep_after_end once, after leave_active. The owner's job index lives while the owner has an active
-- job, and a job TTL after its last one ended; the ended index says which entries a later submission
-- may drop (those that ended a job TTL ago).
-- job: {id, rec, events, idem (nil: none), jobs (owner's jobs), ended (owner's ended jobs),
--       active (owner's active jobs)}
local function keep_after_end(job, ttl, now_ms)
  redis.call('EXPIRE', job.rec, ttl)
  redis.call('EXPIRE', job.events, ttl)
  if job.idem and redis.call('HGET', job.rec, 'idempotency_key') == job.idem then
    redis.call('EXPIRE', job.idem, ttl)
  end
  redis.call('ZADD', job.ended, now_ms, job.id)
  if redis.call('EXISTS', job.active) == 1 then
    redis.call('PERSIST', job.jobs)
    redis.call('PERSIST', job.ended)
  else
    redis.call('EXPIRE', job.jobs, ttl)
    redis.call('EXPIRE', job.ended, ttl)
  end
end
