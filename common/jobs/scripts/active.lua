-- A job is active for its owner (queued or running: the owner's active jobs) from its submission until it
-- ends, however it ends; what it holds against its owner's limits (common/keys.py's
-- prompt_tokens_in_flight: its estimated prompt tokens under its id, its estimated stream bytes under
-- 'bytes:' .. id, each summed in a total) leaves with it, exactly once, in the script of the transition
-- that ends it.
local function leave_active(active, held, id)
  redis.call('ZREM', active, id)
  local tokens_field, bytes_field = id, 'bytes:' .. id
  local v = redis.call('HMGET', held, tokens_field, bytes_field, ':total', ':bytes')
  local gone = {}
  if v[1] then
    gone[#gone + 1] = tokens_field
    redis.call('HINCRBY', held, ':total', 0 - tonumber(v[1]))  -- never -0, which Redis reads as no integer
  end
  if v[2] then
    gone[#gone + 1] = bytes_field
    redis.call('HINCRBY', held, ':bytes', 0 - tonumber(v[2]))
  end
  if #gone > 0 then redis.call('HDEL', held, unpack(gone)) end
  local totals = ((v[1] or v[3]) and 1 or 0) + ((v[2] or v[4]) and 1 or 0)
  if redis.call('HLEN', held) <= totals then redis.call('DEL', held) end
end
