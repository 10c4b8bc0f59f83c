-- include: pairs.lua
-- include: active.lua
-- include: uncount.lua
-- include: note_outcome.lua
-- KEYS: record, queue of its class, events, arq job, queued tokens, owner's active jobs,
--       model's recent outcomes, owner's prompt tokens in flight
-- ARGV: id, now_s, cancel channel, now_ms, outcome window ms, n event fields, fields..., stream notices
--       channel
-- Returns 'cancelled' (was queued), 'cancelling' (running: its worker is told), 'missing', or the
-- job's terminal status.
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'attempts') == '0' then uncount(KEYS[5], KEYS[1]) end
  leave_active(KEYS[6], KEYS[8], ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[3], '*', unpack((pairs_at(7))))
  redis.call('PUBLISH', ARGV[#ARGV], KEYS[3])
  redis.call('DEL', KEYS[4])
  note_outcome(KEYS[7], 'cancelled', ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5]))
  return 'cancelled'
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return 'cancelling'
end
return st
