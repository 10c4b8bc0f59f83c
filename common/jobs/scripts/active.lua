-- A job is active for its owner (queued or running: the owner's active jobs) from its submission until it
-- ends, however it ends; what it holds against its owner's limits (common/keys.py's
-- prompt_tokens_in_flight: its estimated prompt tokens under its id, its estimated stream bytes under
-- 'bytes:' .. id, each summed in a total) leaves with it, exactly once, in the script of the transition
-- that ends it.
local function release_held(held, field, total)
  local n = tonumber(redis.call('HGET', held, field) or '')
  if n then
    redis.call('HDEL', held, field)
    redis.call('HINCRBY', held, total, 0 - n)  -- never -0, which Redis reads as no integer
  end
end
local function leave_active(active, held, id)
  redis.call('ZREM', active, id)
  release_held(held, id, ':total')
  release_held(held, 'bytes:' .. id, ':bytes')
  local totals = redis.call('HEXISTS', held, ':total') + redis.call('HEXISTS', held, ':bytes')
  if redis.call('HLEN', held) <= totals then redis.call('DEL', held) end
end
