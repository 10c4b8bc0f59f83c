-- include: active.lua
-- include: uncount.lua
-- KEYS: record, events, arq job, queue of its class, leases, queued tokens, owner's active jobs,
--       owner's jobs, owner's prompt tokens in flight, owner's ended jobs, idempotency entry (only when
--       the record names one)
-- ARGV: id, cancel channel
-- Returns 1, or 0 when the job does not exist.
local held = redis.call('HMGET', KEYS[1], 'status', 'attempts', 'cost', 'idempotency_key')
if not held[1] then return 0 end
if redis.call('ZREM', KEYS[4], ARGV[1]) == 1 and held[2] == '0' then
  uncount(KEYS[6], held[3])
end
leave_active(KEYS[7], KEYS[9], ARGV[1])
redis.call('ZREM', KEYS[8], ARGV[1])
redis.call('ZREM', KEYS[10], ARGV[1])
local idem = KEYS[11]
if idem and held[4] == idem then redis.call('DEL', idem) end
if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
