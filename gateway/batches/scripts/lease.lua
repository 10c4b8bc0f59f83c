-- KEYS: lease; ARGV: token, lease_ms. Takes the lease if free, renews it if ours.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
