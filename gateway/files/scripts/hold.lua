-- Counts a file among what its key keeps: at least `bytes` for a file still arriving (refused when that
-- would pass the key's limits), or exactly `bytes` for a file written (never refused).
-- KEYS: as kept.lua. ARGV: now (ms), file id, bytes, its expiry (ms), most bytes, most files (0: no
-- limit), exact ('1' or '0').
-- Returns {1, bytes kept, files kept} with the file counted, or {0, 'bytes' or 'files', bytes kept, files
-- kept} when it would pass that limit (nothing changed but expired files dropped).
-- include: kept.lua
local id, bytes, expiry = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local most_bytes, most_files = tonumber(ARGV[5]), tonumber(ARGV[6])
local held = tonumber(redis.call('HGET', sizes, id) or '-1')
local files = redis.call('HLEN', sizes)
if ARGV[7] ~= '1' then
  bytes = math.max(bytes, held)
  local refused = nil
  if held < 0 and most_files > 0 and files >= most_files then
    refused = 'files'
  elseif bytes > held and most_bytes > 0 and total - math.max(held, 0) + bytes > most_bytes then
    refused = 'bytes'
  end
  if refused then
    keep(total)
    return {0, refused, total, files}
  end
end
if held < 0 then
  files = files + 1
end
total = total - math.max(held, 0) + bytes
redis.call('HSET', sizes, id, string.format('%.0f', bytes))
redis.call('ZADD', expiries, expiry, id)
keep(total)
return {1, total, files}
