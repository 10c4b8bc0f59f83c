-- A file leaves what its key keeps: a fragment after kept.lua. Its entry goes first, so that a Redis out
-- of memory lets the sum be written (kept.lua's keep).
-- include: kept.lua
local function forget(file_id)
  local held = redis.call('HGET', sizes, file_id)
  if held then
    total = total - tonumber(held)
    redis.call('HDEL', sizes, file_id)
    redis.call('ZREM', expiries, file_id)
  end
  keep(total)
end
