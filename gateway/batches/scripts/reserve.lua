-- KEYS: batch, lease, in flight, input lines; ARGV: token, the status the batch must have
-- Takes the next line that is not blank: in flight as 'pending'; returns {index, line}, or {} at the end.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {} end
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then return {} end
local total = redis.call('LLEN', KEYS[4])
local at = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
while at < total do
  local line = redis.call('LINDEX', KEYS[4], at)
  at = at + 1
  if string.find(line, '%S') then
    redis.call('HSET', KEYS[1], 'next', at)
    redis.call('HSET', KEYS[3], at - 1, 'pending')
    return {at - 1, line}
  end
end
redis.call('HSET', KEYS[1], 'next', at)
return {}
