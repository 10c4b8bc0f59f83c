-- include: notice.lua
-- include: active.lua
-- include: uncount.lua
-- include: note_outcome.lua
-- include: expire.lua
-- KEYS: queue deadlines, queued tokens, model's recent outcomes, queue of its class, record, events,
--       arq job, owner's active jobs, owner's prompt tokens in flight, owner's jobs, owner's ended jobs,
--       idempotency entry (only when the record names one)
-- ARGV: id, now_ms, outcome window ms, error code of an expired job, owner, ttl_s, stream notices
--       channel
-- The gateways' sweep of the queue deadlines, for jobs no worker claims (none is live): the job fails as
-- CLAIM fails it when still waiting for its first attempt past its deadline. A job that started, ended
-- or is gone leaves the deadlines; one whose owner is not the caller's (it read the record before a
-- purge and a new job) is left for the next sweep. Returns 1 when it expired the job, else 0.
local id, now = ARGV[1], tonumber(ARGV[2])
local job = {id = id, rec = KEYS[5], events = KEYS[6], arq = KEYS[7], active = KEYS[8], held = KEYS[9],
  jobs = KEYS[10], ended = KEYS[11], idem = KEYS[12]}
if redis.call('EXISTS', job.rec) == 1 and (redis.call('HGET', job.rec, 'owner') or '') ~= ARGV[5] then
  return 0
end
local f = deadline_fields(job.rec)
if not past_deadline(f, now) or redis.call('ZREM', KEYS[4], id) == 0 then
  redis.call('ZREM', KEYS[1], id)
  return 0
end
uncount(KEYS[2], f.cost)
local noticed = {}
expire_in_queue(id, job, KEYS[1], KEYS[3], now, tonumber(ARGV[3]), ARGV[4], noticed, ARGV[6])
notice(ARGV[7], table.concat(noticed, ' '))
return 1
