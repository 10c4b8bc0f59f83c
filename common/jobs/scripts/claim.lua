-- include: notice.lua
-- include: append.lua
-- The claim. Which job a worker takes next is decided by `claimable`: the head of the highest class
-- that has waiting jobs, in each class's fair-share order; only a job promised the worker's freed row
-- goes before it. It must pick among the candidates it was given (the only jobs whose keys it holds);
-- a wider choice needs the caller's candidates (common/jobs/claims.py) to look further.
-- include: active.lua
-- include: uncount.lua
-- include: note_outcome.lua
-- include: expire.lua
-- include: fair.lua
-- KEYS: leases, queued tokens, model's recent outcomes, queue deadlines, then per class (highest first):
--       its queue, its fair-share tags; then 8 keys per candidate job: record, events, arq job, its
--       owner's active jobs, its owner's prompt tokens in flight, its owner's jobs, its owner's ended
--       jobs, its idempotency entry (a stand-in when it has none or the owner is not known)
-- ARGV: now_ms, lease_ms, max jobs, worker id, outcome window ms, error code of an expired job,
--       idle ('1': the worker runs nothing, so it may take a suspect job, alone), ttl_s,
--       the worker's KV budget in tokens (0: any job fits), jobs to look at per class,
--       n classes, class names..., stream notices channel,
--       then per candidate: id, owner, whether the owner is known ('1'; else its owner's keys are
--       stand-ins, not to be touched), whether it is promised ('1': see below; its owner is known)
-- Candidates are the jobs the caller saw at the head of each class's queue and in leases that ran
-- out, and the jobs promised this worker's next rows: another key's jobs for which it preempted a row
-- (worker/preemption.py). Jobs whose lease ran out go back to their class's queue first, with the tag
-- they had (they keep their place), suspect: their worker died. Then the promised jobs still queued
-- (and within the worker's KV budget) are taken, wherever they wait in their queue (a suspect one
-- waits its turn), and then jobs from the head of the highest class with waiting jobs while that head
-- is a candidate. A suspect job is taken only by an idle
-- worker that took nothing else in this claim, and then alone: its attempt is quarantined. The
-- script stops, and says why, at the first that is not a candidate (the head moved since the caller
-- looked: 1), or that expired in the queue while the caller did not know its owner (2); the caller
-- looks again, then knowing every candidate's owner. It stops too at a suspect job it may not take,
-- and at a job whose preferred worker (the one that holds its prompt's KV) is another, until the job's
-- preferred_until_ms (3): that worker takes it meanwhile, or any worker after. A job that needs more KV
-- tokens (its record's kv_tokens: prompt and max_tokens) than the worker's budget is passed over, left
-- for a worker with a larger one: the worker looks at the next in its class, among the first it was
-- told to look at.
-- Returns {why it stopped early (ClaimStop in common/jobs/claims.py: 0 it did not, 1 the head moved,
-- 2 an owner is needed, 3 the head waits for its preferred worker), whether a suspect job waits for
-- an idle worker ('1'/'0'),
-- then per claimed job: id, attempt, arq payload, owner, quarantined ('1'/'0'), deaths in quarantine,
-- its idempotency entry ('' for none)}.
local now = tonumber(ARGV[1])
local idle = ARGV[7] == '1'
local ttl, budget, scan = ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local nclass = tonumber(ARGV[11])
local queues, tags, class_at = {}, {}, {}
for c = 1, nclass do
  queues[c], tags[c] = KEYS[3 + 2 * c], KEYS[4 + 2 * c]
  class_at[ARGV[11 + c]] = c
end
local notices, noticed = ARGV[12 + nclass], {}
local candidates, promised = {}, {}
local n = 0
for i = 13 + nclass, #ARGV - 3, 4 do
  local k = 4 + 2 * nclass + 8 * n
  candidates[ARGV[i]] = {id = ARGV[i], owner = ARGV[i + 1], known = ARGV[i + 2] == '1', rec = KEYS[k + 1],
    events = KEYS[k + 2], arq = KEYS[k + 3], active = KEYS[k + 4], held = KEYS[k + 5], jobs = KEYS[k + 6],
    ended = KEYS[k + 7], idem = KEYS[k + 8]}
  if ARGV[i + 3] == '1' then promised[#promised + 1] = ARGV[i] end
  n = n + 1
end

-- A worker died holding the job (its lease ran out): the job is suspect. A death during a quarantined
-- attempt (one that ran alone on its worker) is evidence against the job, and is counted.
local function worker_lost(job)
  local attempt = redis.call('HGET', job.rec, 'attempts')
  if not attempt then return end
  redis.call('HINCRBY', job.rec, 'worker_deaths', 1)
  if redis.call('HGET', job.rec, 'quarantined_attempt') == attempt then
    redis.call('HINCRBY', job.rec, 'quarantine_deaths', 1)
  end
  redis.call('HSET', job.rec, 'suspect', '1')
  append_event(job.rec, job.events, {'type', 'status', 'status', 'queued', 'reason', 'worker_lost',
    'attempt', attempt})
  noticed[#noticed + 1] = job.events
end

-- Only candidates: the script holds the keys of no other job (a lease that runs out meanwhile waits
-- for the next claim).
local function requeue_expired_leases()
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
    local job = candidates[id]
    if job then
      local c = class_at[redis.call('HGET', job.rec, 'priority') or ''] or 1
      redis.call('ZREM', KEYS[1], id)
      redis.call('ZADD', queues[c], redis.call('HGET', job.rec, 'tag') or '0', id)
      worker_lost(job)
    end
  end
end

-- What the claim reads of a candidate's record, in one HMGET when first needed: only
-- requeue_expired_leases (which runs before) writes a field read here.
local READ = {'status', 'attempts', 'owner', 'kv_tokens', 'suspect', 'preferred_worker', 'preferred_until_ms',
  'quarantine_deaths', 'idempotency_key', 'deadline_ms', 'cost'}
local function fields(job)
  if not job.fields then
    local values = redis.call('HMGET', job.rec, unpack(READ))
    job.fields = {}
    for i, name in ipairs(READ) do job.fields[name] = values[i] end
  end
  return job.fields
end
-- The next job to consider: the head of the highest class with waiting jobs, if the caller passed its
-- keys, passing over the jobs that need more KV than the worker's budget; with its class and score.
local function fits(job)
  return budget <= 0 or tonumber(fields(job).kv_tokens or '0') <= budget
end
local function claimable()
  for c = 1, nclass do
    local waiting = redis.call('ZRANGE', queues[c], 0, scan - 1, 'WITHSCORES')
    for i = 1, #waiting, 2 do
      local job = candidates[waiting[i]]
      if not job or (job.known and (fields(job).owner or '') ~= job.owner) then
        return nil, true
      end
      if fits(job) then return waiting[i], false, c, tonumber(waiting[i + 1]) end
    end
  end
  return nil, false
end

-- The class whose queue holds the job and its score there; nil when it waits in none.
local function queued_in(id)
  for c = 1, nclass do
    local score = redis.call('ZSCORE', queues[c], id)
    if score then return c, tonumber(score) end
  end
end

requeue_expired_leases()
local out = {0, '0'}
local taken = 0
local wanted = tonumber(ARGV[3])

-- The job leaves its queue (c, at score): claimed, or failed as expired in the queue.
local function take(id, job, c, score, suspect)
  local f = fields(job)
  local expired = past_deadline(f, now)
  redis.call('ZREM', queues[c], id)
  advance(tags[c], score)
  if f.attempts == '0' then
    uncount(KEYS[2], f.cost)
    redis.call('ZREM', KEYS[4], id)
  end
  if expired then
    expire_in_queue(id, job, KEYS[4], KEYS[3], now, tonumber(ARGV[5]), ARGV[6], noticed, ttl)
  elseif f.status == 'queued' or f.status == 'running' then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    local attempt = redis.call('HINCRBY', job.rec, 'attempts', 1)
    local started = {'status', 'running', 'worker', ARGV[4], 'started_at', now / 1000}
    if suspect then
      started[#started + 1] = 'quarantined_attempt'
      started[#started + 1] = attempt
    end
    redis.call('HSET', job.rec, unpack(started))
    out[#out + 1] = id
    out[#out + 1] = attempt
    out[#out + 1] = redis.call('GET', job.arq) or ''
    out[#out + 1] = f.owner or ''
    out[#out + 1] = suspect and '1' or '0'
    out[#out + 1] = f.quarantine_deaths or '0'
    out[#out + 1] = f.idempotency_key or ''
    taken = taken + 1
  end
end

for _, id in ipairs(promised) do
  local job = candidates[id]
  local c, score = queued_in(id)
  if taken < wanted and c and job.known and fits(job) and fields(job).suspect ~= '1' then
    take(id, job, c, score, false)
  end
end
while taken < wanted do
  local id, moved, c, score = claimable()
  if not id then
    if moved then out[1] = 1 end
    break
  end
  local job = candidates[id]
  local f = fields(job)
  local suspect = f.suspect == '1'
  if suspect and (taken > 0 or not idle) then
    out[2] = '1'
    break
  end
  if f.preferred_worker and f.preferred_worker ~= ARGV[4] and not suspect
    and now < tonumber(f.preferred_until_ms or '0') then
    out[1] = 3
    break
  end
  if not job.known and past_deadline(f, now) then
    out[1] = 2
    break
  end
  take(id, job, c, score, suspect)
  if suspect then break end
end
if #noticed > 0 then notice(notices, table.concat(noticed, ' ')) end
return out
