-- include: notice.lua
-- include: append.lua
-- include: pairs.lua
-- include: active.lua
-- include: uncount.lua
-- include: note_outcome.lua
-- include: ended.lua
-- KEYS: record, queue of its class, events, arq job, queued tokens, owner's active jobs,
--       model's recent outcomes, owner's prompt tokens in flight, owner's jobs, owner's ended jobs,
--       idempotency entry (only when the record names one)
-- ARGV: id, now_s, cancel channel, now_ms, outcome window ms, ttl_s, n event fields, fields..., stream
--       notices channel
-- Returns 'cancelled' (was queued), 'cancelling' (running: its worker is told), 'missing', or the
-- job's terminal status.
local held = redis.call('HMGET', KEYS[1], 'status', 'attempts', 'cost')
local st = held[1]
if not st then return 'missing' end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  if held[2] == '0' then uncount(KEYS[5], held[3]) end
  leave_active(KEYS[6], KEYS[8], ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2])
  append_event(KEYS[1], KEYS[3], (pairs_at(8)))
  notice(ARGV[#ARGV], KEYS[3])
  redis.call('DEL', KEYS[4])
  note_outcome(KEYS[7], 'cancelled', ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5]))
  keep_after_end({id = ARGV[1], rec = KEYS[1], events = KEYS[3], idem = KEYS[11], jobs = KEYS[9],
    ended = KEYS[10], active = KEYS[6]}, ARGV[6], ARGV[4])
  return 'cancelled'
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return 'cancelling'
end
return st
