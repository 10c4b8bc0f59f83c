-- KEYS: the model's slots being freed for interactive work; ARGV: slots, jobs waiting, expiry ms
-- A worker about to preempt batch work reserves the slots it will free; it backs off (returns 0)
-- when the slots other workers are freeing already cover the waiting interactive jobs. Each slot's
-- reservation ends when its job is back in the queue (or ended); all lapse after the expiry, should
-- a worker die meanwhile. Slots: negative to end reservations.
local slots = tonumber(ARGV[1])
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
if slots > 0 and before >= tonumber(ARGV[2]) then return 0 end
if before + slots <= 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('INCRBY', KEYS[1], slots)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
