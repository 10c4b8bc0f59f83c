-- Weighted fair share between keys within a priority class, by tokens: start-time fair queuing.
-- A job's start tag S = max(V, F[key]), where V (':v') is the start tag of the class's last claimed job
-- and F[key] the finish tag of the key's last job; the key's F becomes S + cost / weight. Tags count in
-- 1/UNIT tokens; the queue's score is S * SEQ + a submission counter, so equal tags keep submission
-- order. A key idle for a while starts at V again: it holds no credit. Scores stay exact doubles
-- (below 2^53) for 2^43 / UNIT tokens of a class's virtual time.
local UNIT, SEQ = 8, 1024
local function num(x) return string.format('%.0f', x) end
local function fair_tag(tags, owner, cost, weight)
  local held = redis.call('HMGET', tags, ':v', owner)
  local s = math.max(tonumber(held[1] or '0'), tonumber(held[2] or '0'))
  redis.call('HSET', tags, owner, num(s + math.ceil(cost * UNIT / weight)))
  local seq = redis.call('HINCRBY', tags, ':seq', 1) % SEQ
  return num(s * SEQ + seq)
end
local function advance(tags, score)
  local s = math.floor(score / SEQ)
  if s > tonumber(redis.call('HGET', tags, ':v') or '0') then redis.call('HSET', tags, ':v', num(s)) end
end
