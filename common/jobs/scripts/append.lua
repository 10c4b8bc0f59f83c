-- A job's stream and its record's `tail`, the id of the stream's newest entry: the step writes
-- (publish_step.lua) take it from the record rather than read the stream. Every script that adds an
-- entry to a job's stream adds it here (tests/test_lua_scripts.py checks that none adds one otherwise).
local function append_event(rec, events, fields)
  local id = redis.call('XADD', events, '*', unpack(fields))
  redis.call('HSET', rec, 'tail', id)
  return id
end
