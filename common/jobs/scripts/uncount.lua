-- A job's cost leaves the model's queued-token count when it first starts, expires or is cancelled; the
-- count is gone when no job waits (it has no expiry: it lives while jobs wait).
-- cost: the record's cost field (false where it has none).
local function uncount(counter, cost_field)
  local cost = tonumber(cost_field or '0')
  if cost > 0 and redis.call('DECRBY', counter, cost) <= 0 then redis.call('DEL', counter) end
end
