-- KEYS: batch, in flight, output lines, error lines; ARGV: index, expected (job id or 'pending'),
--   'output' or 'error', the line, ttl_s
-- Answers the line once: only while it is still in flight with the expected job.
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[3] == 'output' then
  redis.call('RPUSH', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'completed', 1)
  redis.call('HINCRBY', KEYS[1], 'output_bytes', string.len(ARGV[4]))
else
  redis.call('RPUSH', KEYS[4], ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
  redis.call('HINCRBY', KEYS[1], 'error_bytes', string.len(ARGV[4]))
end
return 1
