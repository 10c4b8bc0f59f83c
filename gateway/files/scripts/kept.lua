-- What a key keeps in files, read after dropping the files whose expiry has passed (their keys gone by
-- TTL, or soon): a fragment of hold.lua, release.lua and delete.lua. KEYS[1..3]: the key's file sizes
-- (hash: file id -> bytes), their expiries (zset: file id -> ms), the sum of the sizes (string); ARGV[1]
-- is now (ms).
local sizes, expiries, total_key = KEYS[1], KEYS[2], KEYS[3]
local total = tonumber(redis.call('GET', total_key) or '0')
local written = total
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', expiries, '-inf', ARGV[1], 'LIMIT', 0, 1000)) do
  total = total - tonumber(redis.call('HGET', sizes, gone) or '0')
  redis.call('HDEL', sizes, gone)
  redis.call('ZREM', expiries, gone)
end

-- Writes the sum; the three keys live as long as the file that expires last, and go with the last file.
-- The sum is written only when it changed, after a file's entry was: a Redis out of memory refuses a
-- script's first write that could grow it (SET), never a later one, so a file leaves the count even then.
local function keep(sum)
  local last = redis.call('ZRANGE', expiries, -1, -1, 'WITHSCORES')
  if last[2] == nil then
    redis.call('DEL', sizes, expiries, total_key)
    return
  end
  if sum ~= written then
    redis.call('SET', total_key, string.format('%.0f', sum))
  end
  for _, key in ipairs({sizes, expiries, total_key}) do
    redis.call('PEXPIREAT', key, string.format('%.0f', last[2] + 1000))
  end
end
