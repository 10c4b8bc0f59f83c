-- A job is active for its owner (queued or running: the owner's active jobs) from its submission until it
-- ends, however it ends; the estimated prompt tokens it holds against its owner's limit (common/keys.py's
-- prompt_tokens_in_flight) leave with it, exactly once, in the script of the transition that ends it.
local function leave_active(active, held, id)
  redis.call('ZREM', active, id)
  local n = tonumber(redis.call('HGET', held, id) or '')
  if n then
    redis.call('HDEL', held, id)
    redis.call('HINCRBY', held, ':total', 0 - n)  -- never -0, which Redis reads as no integer
    if redis.call('HLEN', held) <= 1 then redis.call('DEL', held) end
  end
end
