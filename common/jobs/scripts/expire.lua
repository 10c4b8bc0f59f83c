-- include: append.lua
-- A job still waiting for its first attempt past its queue deadline fails as expired, in CLAIM (a worker
-- reaches it at the head of its queue) and in EXPIRE_QUEUED (the gateways' sweep, which needs no worker).
-- The caller has taken it out of its queue and its cost off the queued tokens.
-- include: active.lua
-- include: note_outcome.lua
-- include: ended.lua
local function past_deadline(rec, now)
  local deadline = tonumber(redis.call('HGET', rec, 'deadline_ms') or '0')
  return redis.call('HGET', rec, 'attempts') == '0' and redis.call('HGET', rec, 'status') == 'queued'
    and deadline > 0 and now > deadline
end
-- job: {rec, events, arq, active, held} and ended.lua's {id, idem, jobs, ended}
local function expire_in_queue(id, job, deadlines, outcomes, now, window_ms, code, noticed, ttl)
  local created = tonumber(redis.call('HGET', job.rec, 'created_at') or '')
  local waited = created and string.format('%.1f', (now - created * 1000) / 1000) or '?'
  local message = 'expired in queue: waited ' .. waited .. ' s, past the queue deadline'
  redis.call('HSET', job.rec, 'status', 'failed', 'finish_reason', 'error', 'error', message,
    'error_code', code, 'finished_at', now / 1000)
  append_event(job.rec, job.events, {'type', 'error', 'status', 'failed', 'message', message,
    'code', code})
  noticed[#noticed + 1] = job.events
  redis.call('DEL', job.arq)
  leave_active(job.active, job.held, id)
  redis.call('ZREM', deadlines, id)
  note_outcome(outcomes, 'failed', id, now, window_ms)
  keep_after_end(job, ttl, now)
end
