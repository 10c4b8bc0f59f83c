-- include: append.lua
-- include: pairs.lua
-- include: fair.lua
-- KEYS: record, events, arq job, queue of its class, queued tokens, owner's active jobs, owner's jobs,
--       fair-share tags of its class, the Redis's epoch, queue deadlines, owner's prompt tokens in
--       flight, owner's ended jobs, idempotency entry (only with an idempotency key)
-- ARGV: id, ttl_s, now_ms, max queued jobs, arq payload, wake channel, cost, max queued tokens,
--       owner's max active jobs (0: no limit), owner, weight, its prompt tokens (estimated), owner's max
--       prompt tokens in flight (0: no limit), its stream bytes (estimated), owner's max stream bytes in
--       flight (0: no limit), n record fields, fields..., n event fields, fields..., its queue deadline ms
--       ('': none), the epoch the job id carries ('': not checked)
-- Returns {outcome, detail}: created/duplicate and the job id, busy, prompt_tokens and the prompt
-- tokens the owner's active jobs hold, stream_bytes and the stream bytes they hold, full and which
-- limit, or epoch when the Redis's epoch is not the job id's (it lost its data since the caller read
-- it). A job is over the prompt-token or stream-byte limit only when the owner has some in flight: a
-- lone job of any size is taken.
-- Nothing the job needs while queued or running expires: its record, stream, payload and idempotency
-- entry get the job TTL when it ends (ended.lua), and the queue, the queued tokens, the deadlines, the
-- owner's active jobs and prompt tokens are gone once empty. Keys an older version gave an expiry lose it.
local epoch = ARGV[#ARGV]
if epoch ~= '' and redis.call('GET', KEYS[9]) ~= epoch then return {'epoch', ''} end
local idem = KEYS[13]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return {'duplicate', existing} end
end
local horizon = tonumber(ARGV[3]) - tonumber(ARGV[2]) * 1000
local max_active = tonumber(ARGV[9])
if max_active > 0 and redis.call('ZCARD', KEYS[6]) >= max_active then return {'busy', ''} end
local prompt, max_prompt = tonumber(ARGV[12]), tonumber(ARGV[13])
local totals = redis.call('HMGET', KEYS[11], ':total', ':bytes')
local holding = tonumber(totals[1] or '0')
if max_prompt > 0 and holding > 0 and holding + prompt > max_prompt then
  return {'prompt_tokens', tostring(holding)}
end
local bytes, max_bytes = tonumber(ARGV[14]), tonumber(ARGV[15])
local holding_bytes = tonumber(totals[2] or '0')
if max_bytes > 0 and holding_bytes > 0 and holding_bytes + bytes > max_bytes then
  return {'stream_bytes', tostring(holding_bytes)}
end
if redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[4]) then return {'full', 'jobs'} end
local cost = tonumber(ARGV[7])
local queued = tonumber(redis.call('GET', KEYS[5]) or '0')
if queued > 0 and queued + cost > tonumber(ARGV[8]) then return {'full', 'tokens'} end
local ttl = tonumber(ARGV[2])
local rec, at = pairs_at(17)
local tag = fair_tag(KEYS[8], ARGV[10], cost, tonumber(ARGV[11]))
redis.call('EXPIRE', KEYS[8], ttl)
redis.call('HSET', KEYS[1], 'tag', tag, unpack(rec))
local ev = pairs_at(at + 1)
append_event(KEYS[1], KEYS[2], ev)
redis.call('SET', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[4], tag, ARGV[1])
redis.call('INCRBY', KEYS[5], cost)
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[11], ARGV[1], prompt, 'bytes:' .. ARGV[1], bytes)
redis.call('HINCRBY', KEYS[11], ':total', prompt)
redis.call('HINCRBY', KEYS[11], ':bytes', bytes)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[12], '-inf', horizon)) do
  redis.call('ZREM', KEYS[7], gone)  -- it ended a job TTL ago: its record expired
end
redis.call('ZREMRANGEBYSCORE', KEYS[12], '-inf', horizon)
redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
if idem then redis.call('SET', idem, ARGV[1]) end
if ARGV[#ARGV - 1] ~= '' then redis.call('ZADD', KEYS[10], ARGV[#ARGV - 1], ARGV[1]) end
for _, k in ipairs({4, 5, 6, 7, 10, 11, 12}) do redis.call('PERSIST', KEYS[k]) end
redis.call('PUBLISH', ARGV[6], ARGV[1])
return {'created', ARGV[1]}
