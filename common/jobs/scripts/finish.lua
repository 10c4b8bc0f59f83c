-- include: append.lua
-- include: pairs.lua
-- include: active.lua
-- include: fair.lua
-- include: ended.lua
-- KEYS: record, events, leases, arq job, owner's active jobs, fair-share tags of its class,
--       model's served tokens, owner's prompt tokens in flight, owner's jobs, owner's ended jobs,
--       idempotency entry (only when the record names one)
-- ARGV: attempt, id, ttl_s, tokens served (prompt and generated; -1: unknown), its class,
--       tokens the attempt streamed ('': not checked), now_ms, n record fields, fields..., n event
--       fields, fields..., stream notices channel
-- Returns (FinishOutcome in common/jobs/writes.py) 1, 0 once the attempt lost the job, or 2 (nothing written) when the stream holds fewer
-- tokens than the attempt streamed (a failover lost the newest: the worker writes them again first).
-- The owner's finish tag is corrected by what the job really cost against its estimate (never
-- below the class's virtual time), and the tokens count in the served totals of its class and key.
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
if ARGV[6] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'streamed') or '0') < tonumber(ARGV[6]) then
  return 2
end
local served = tonumber(ARGV[4])
if served >= 0 then
  local owner = redis.call('HGET', KEYS[1], 'owner') or ''
  local class = ARGV[5]
  local f = tonumber(redis.call('HGET', KEYS[6], owner) or '')
  if f then
    local cost = tonumber(redis.call('HGET', KEYS[1], 'cost') or '0')
    local weight = tonumber(redis.call('HGET', KEYS[1], 'weight') or '1')
    local v = tonumber(redis.call('HGET', KEYS[6], ':v') or '0')
    redis.call('HSET', KEYS[6], owner, num(math.max(v, f + math.floor((served - cost) * UNIT / weight))))
  end
  redis.call('HINCRBY', KEYS[7], class, served)
  redis.call('HINCRBY', KEYS[7], class .. ':' .. owner, served)
  redis.call('EXPIRE', KEYS[7], ARGV[3])
end
local rec, at = pairs_at(9)
redis.call('HSET', KEYS[1], unpack(rec))
append_event(KEYS[1], KEYS[2], (pairs_at(at + 1)))
redis.call('PUBLISH', ARGV[#ARGV], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
leave_active(KEYS[5], KEYS[8], ARGV[2])
keep_after_end({id = ARGV[2], rec = KEYS[1], events = KEYS[2], idem = KEYS[11], jobs = KEYS[9],
  ended = KEYS[10], active = KEYS[5]}, ARGV[3], ARGV[7])
return 1
