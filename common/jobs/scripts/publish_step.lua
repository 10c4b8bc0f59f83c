-- include: notice.lua
-- The writes of one engine step for all of a worker's running jobs, each fenced by its own attempt.
-- KEYS: per job, in order: record, events
-- ARGV: per job: attempt, from, to, n record fields, fields..., n entries, then per entry: n fields,
--       fields..., the entry's fields as a JSON array; last, the stream notices channel
--   from, to: the token index of the write's first token entry and the index past its last one ('' when
--   it has none, or when from must not be checked). The record's `streamed` says where the stream's
--   tokens end: a write that starts past it (the newest entries were lost, as in a failover to a replica
--   that had not received them) is refused whole, so that the worker writes the missing ones first.
-- Returns per job the entries written, -1 where the attempt no longer owns the job, -2 where the write
-- would leave a gap (read as StepResult in common/jobs/writes.py).
-- The notice names the streams written, and after a newline carries their new entries as JSON:
-- [[stream, id of the entry before, [[id, [field, value, ...]], ...]], ...]. Each entry's JSON comes
-- made (the writer encodes it), so that the script only joins strings.
local out = {}
local noticed, carried = {}, {}
local at = 1
for j = 1, #KEYS / 2 do
  local record, events = KEYS[2 * j - 1], KEYS[2 * j]
  local status = -1
  local streamed = 0
  local held = redis.call('HMGET', record, 'attempts', 'streamed', 'tail')
  if held[1] == ARGV[at] then
    status = 0
    streamed = tonumber(held[2] or '0')
    if ARGV[at + 1] ~= '' and tonumber(ARGV[at + 1]) > streamed then status = -2 end
  end
  local writing = status == 0
  local to = ARGV[at + 2]
  local nrec = tonumber(ARGV[at + 3])
  local rec = {}
  if writing then
    for i = at + 4, at + 3 + 2 * nrec do rec[#rec + 1] = ARGV[i] end
    if to ~= '' and tonumber(to) > streamed then
      rec[#rec + 1] = 'streamed'
      rec[#rec + 1] = to
    end
  end
  at = at + 4 + 2 * nrec
  local entries = tonumber(ARGV[at])
  at = at + 1
  local written, added, after = 0, {}, '0-0'
  if writing and entries > 0 then
    if held[3] then
      after = held[3]
    else  -- a stream written before records kept their tail
      local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)[1]
      if last then after = last[1] end
    end
  end
  local id
  for _ = 1, entries do
    local n = tonumber(ARGV[at])
    if writing then
      id = redis.call('XADD', events, '*', unpack(ARGV, at + 1, at + 2 * n))
      added[#added + 1] = '["' .. id .. '",' .. ARGV[at + 2 * n + 1] .. ']'
      written = written + 1
    end
    at = at + 2 + 2 * n
  end
  if id then
    rec[#rec + 1] = 'tail'
    rec[#rec + 1] = id
  end
  if #rec > 0 then redis.call('HSET', record, unpack(rec)) end
  out[j] = writing and written or status
  if writing and written > 0 then
    noticed[#noticed + 1] = events
    carried[#carried + 1] = '[' .. cjson.encode(events) .. ',"' .. after .. '",[' .. table.concat(added, ',') .. ']]'
  end
end
if #noticed > 0 then
  notice(ARGV[#ARGV], table.concat(noticed, ' ') .. '\n[' .. table.concat(carried, ',') .. ']')
end
return out
