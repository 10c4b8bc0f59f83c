-- include: notice.lua
-- include: append.lua
-- include: pairs.lua
-- include: active.lua
-- include: fair.lua
-- include: ended.lua
-- include: note_outcome.lua
-- KEYS: record, events, leases, arq job, owner's active jobs, fair-share tags of its class,
--       model's served tokens, owner's prompt tokens in flight, owner's jobs, owner's ended jobs,
--       model's recent outcomes, idempotency entry (only when the record names one)
-- ARGV: attempt, id, ttl_s, tokens served (prompt and generated; -1: unknown), its class,
--       tokens the attempt streamed ('': not checked), now_ms, the job's outcome for the recent outcomes
--       (its status; '': none), outcome window ms, n record fields, fields..., n event fields, fields...,
--       stream notices channel
-- Returns (FinishOutcome in common/jobs/writes.py) 1, 0 once the attempt lost the job, or 2 (nothing written) when the stream holds fewer
-- tokens than the attempt streamed (a failover lost the newest: the worker writes them again first).
-- The owner's finish tag is corrected by what the job really cost against its estimate (never
-- below the class's virtual time), the tokens count in the served totals of its class and key, and
-- the outcome in the model's recent outcomes (common/fleet_stats.py), once, with the write that ends it.
local held = redis.call('HMGET', KEYS[1], 'attempts', 'streamed', 'owner', 'cost', 'weight')
if held[1] ~= ARGV[1] then return 0 end
if ARGV[6] ~= '' and tonumber(held[2] or '0') < tonumber(ARGV[6]) then return 2 end
local served = tonumber(ARGV[4])
if served >= 0 then
  local owner = held[3] or ''
  local class = ARGV[5]
  local tags = redis.call('HMGET', KEYS[6], owner, ':v')
  local f = tonumber(tags[1] or '')
  if f then
    local cost = tonumber(held[4] or '0')
    local weight = tonumber(held[5] or '1')
    local v = tonumber(tags[2] or '0')
    redis.call('HSET', KEYS[6], owner, num(math.max(v, f + math.floor((served - cost) * UNIT / weight))))
  end
  redis.call('HINCRBY', KEYS[7], class, served)
  redis.call('HINCRBY', KEYS[7], class .. ':' .. owner, served)
  redis.call('EXPIRE', KEYS[7], ARGV[3])
end
local rec, at = pairs_at(11)
redis.call('HSET', KEYS[1], unpack(rec))
append_event(KEYS[1], KEYS[2], (pairs_at(at + 1)))
notice(ARGV[#ARGV], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
leave_active(KEYS[5], KEYS[8], ARGV[2])
if ARGV[8] ~= '' then note_outcome(KEYS[11], ARGV[8], ARGV[2], tonumber(ARGV[7]), tonumber(ARGV[9])) end
keep_after_end({id = ARGV[2], rec = KEYS[1], events = KEYS[2], idem = KEYS[12], jobs = KEYS[9],
  ended = KEYS[10], active = KEYS[5]}, ARGV[3], ARGV[7])
return 1
