-- A job that ends without a worker (cancelled or expired while queued) counts in the model's recent
-- outcomes, as those a worker ends do (common/fleet_stats.py).
local function note_outcome(key, status, id, now_ms, window_ms)
  redis.call('ZADD', key, now_ms, status .. ':' .. id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - window_ms)
  redis.call('PEXPIRE', key, 2 * window_ms)
end
