-- A generic cell rate: the key's budget is a time, pushed on by each call's characters / rate; a call that
-- would push it more than the burst past now waits, unless the budget is full (any one call passes then).
-- KEYS: the key's budget; ARGV: now ms, characters, characters per second, burst ms.
-- Returns 0 (taken) or the ms until the call would be.
local now, burst = tonumber(ARGV[1]), tonumber(ARGV[4])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now)
local after = tat + tonumber(ARGV[2]) * 1000 / tonumber(ARGV[3])
if tat > now and after - now > burst then return math.ceil(math.min(tat - now, after - now - burst)) end
redis.call('SET', KEYS[1], string.format('%.0f', after), 'PX', math.ceil(after - now) + 1)
return 0
