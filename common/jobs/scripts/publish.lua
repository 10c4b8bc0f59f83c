-- include: notice.lua
-- include: append.lua
-- include: pairs.lua
-- KEYS: record, events
-- ARGV: attempt, n record fields, fields..., n entries, then per entry: n fields, fields...,
--       stream notices channel
-- Returns the entries written, or -1 once the attempt lost the job.
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return -1 end
local rec, at = pairs_at(3)
if #rec > 0 then redis.call('HSET', KEYS[1], unpack(rec)) end
local written = 0
local next_at = at + 1
for _ = 1, tonumber(ARGV[at]) do
  local ev
  ev, next_at = pairs_at(next_at + 1)
  append_event(KEYS[1], KEYS[2], ev)
  written = written + 1
end
if written > 0 then notice(ARGV[#ARGV], KEYS[2]) end
return written
