-- KEYS: leases, then the record of each job; ARGV: lease expiry ms, then per job: id, attempt
-- Pushes the lease of each job the attempt still holds to the expiry; returns how many.
local renewed = 0
for i = 2, #KEYS do
  local id, attempt = ARGV[2 * i - 2], ARGV[2 * i - 1]
  if redis.call('HGET', KEYS[i], 'attempts') == attempt then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], id)
    renewed = renewed + 1
  end
end
return renewed
