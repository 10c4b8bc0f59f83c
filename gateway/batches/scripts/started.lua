-- KEYS: in flight; ARGV: index, job id
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
