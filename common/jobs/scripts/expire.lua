-- include: append.lua
-- A job still waiting for its first attempt past its queue deadline fails as expired, in CLAIM (a worker
-- reaches it at the head of its queue) and in EXPIRE_QUEUED (the gateways' sweep, which needs no worker).
-- The caller has taken it out of its queue and its cost off the queued tokens.
-- include: active.lua
-- include: note_outcome.lua
-- include: ended.lua
-- f: the record's deadline_ms, attempts and status (false where missing, as HMGET gives them).
local function past_deadline(f, now)
  local deadline = tonumber(f.deadline_ms or '0')
  return f.attempts == '0' and f.status == 'queued' and deadline > 0 and now > deadline
end
local function deadline_fields(rec)
  local v = redis.call('HMGET', rec, 'deadline_ms', 'attempts', 'status', 'cost')
  return {deadline_ms = v[1], attempts = v[2], status = v[3], cost = v[4]}
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
