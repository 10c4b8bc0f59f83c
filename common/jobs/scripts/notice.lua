-- Publishes a stream notice (the keys of job streams just added to) on the store's notices channel. On
-- a Redis Cluster the channel carries the store's hash tag: a sharded publish, heard on the node that
-- serves the store's slot (and its replicas), not broadcast to every node of the cluster.
local function notice(channel, message)
  if string.find(channel, '{', 1, true) then
    return redis.call('SPUBLISH', channel, message)
  end
  return redis.call('PUBLISH', channel, message)
end
