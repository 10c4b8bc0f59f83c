-- Deletes a file of its owner, with its lines, its place in the owner's list and its count, unless the
-- batches not yet ended changed since the caller read them (and found none reading the file). One script,
-- not a transaction: a Redis out of memory refuses every command of a MULTI, and deleting is how a key
-- gives memory back.
-- KEYS: the owner's file quota keys (kept.lua), the file, its lines, the owner's files, the active batches.
-- ARGV: now (ms), file id, owner, then the ids of the active batches as read.
-- Returns 1 (deleted), 0 (the owner has no such file), -1 (the active batches changed: look again).
-- include: kept.lua
-- include: forget.lua
if redis.call('HGET', KEYS[4], 'owner') ~= ARGV[3] then
  return 0
end
local active = redis.call('ZRANGE', KEYS[7], 0, -1)
if #active ~= #ARGV - 3 then
  return -1
end
for i, batch_id in ipairs(active) do
  if ARGV[i + 3] ~= batch_id then
    return -1
  end
end
redis.call('DEL', KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[6], ARGV[2])
forget(ARGV[2])
return 1
