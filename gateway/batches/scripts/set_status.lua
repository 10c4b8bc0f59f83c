-- KEYS: batch, and its lease for a driver's move (none for a client's request); ARGV: token, from
--       statuses (comma-separated), to, n fields, fields...
if KEYS[2] and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 'lease' end
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
local allowed = false
for s in string.gmatch(ARGV[2], '[^,]+') do if s == st then allowed = true end end
if not allowed then return st end
redis.call('HSET', KEYS[1], 'status', ARGV[3])
local n = tonumber(ARGV[4])
for i = 5, 4 + 2 * n, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 'ok'
