-- KEYS: queue of its class, leases, record; ARGV: id, attempt, preempted (1 or 0)
-- Puts a job its attempt still holds back in its class's queue with the tag it had (its place); a
-- preempted job counts the preemption, which is not an attempt. Returns 1, or 0 when the attempt no
-- longer holds it (its lease ran out and another worker may have claimed it since).
if redis.call('HGET', KEYS[3], 'attempts') ~= ARGV[2] then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[1], redis.call('HGET', KEYS[3], 'tag') or '0', ARGV[1])
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'preemptions', 1) end
  return 1
end
return 0
