"""The Lua scripts of the job state machine (common/jobqueue.py): one atomic script per transition.

Every key a script touches comes in KEYS (the caller derives them with common/keys.py); no script
builds a key name. Record field names are those of common/records.py. A worker's writes carry its
attempt number and change nothing once the job's record counts another attempt.

A script that adds entries to job streams publishes their keys, space-separated, on the stream
notices channel (its last ARGV; CLAIM's after the class names) in one message: each gateway's relay
reads just the streams it is told of (gateway/streaming/relay.py). The step write, which carries nearly
all of a stream's entries, adds after a newline the entries themselves, as JSON: per stream `[key, the
id of the entry before them, [[id, [field, value, ...]], ...]]`, which a relay hands out without reading
them back.
A reader of the keys alone (split on whitespace) still finds every stream it follows.
"""

from __future__ import annotations

# Pairs of ARGV from `at`, as many as ARGV[at - 1] says, for HSET/XADD.
_PAIRS = """
local function pairs_at(at)
  local out = {}
  for i = at, at - 1 + 2 * tonumber(ARGV[at - 1]) do out[#out + 1] = ARGV[i] end
  return out, at + 2 * tonumber(ARGV[at - 1])
end
"""

# A job's cost leaves the model's queued-token count when it first starts, expires or is cancelled.
_UNCOUNT = """
local function uncount(counter, rec)
  local cost = tonumber(redis.call('HGET', rec, 'cost') or '0')
  if cost > 0 and redis.call('DECRBY', counter, cost) < 0 then redis.call('SET', counter, 0) end
end
"""

# A job is active for its owner (queued or running: the owner's active jobs) from its submission until it
# ends, however it ends; the estimated prompt tokens it holds against its owner's limit (common/keys.py's
# prompt_tokens_in_flight) leave with it, exactly once, in the script of the transition that ends it.
_ACTIVE = """
local function leave_active(active, held, id)
  redis.call('ZREM', active, id)
  local n = tonumber(redis.call('HGET', held, id) or '')
  if n then
    redis.call('HDEL', held, id)
    redis.call('HINCRBY', held, ':total', 0 - n)  -- never -0, which Redis reads as no integer
    if redis.call('HLEN', held) <= 1 then redis.call('DEL', held) end
  end
end
"""

# A job that ends without a worker (cancelled or expired while queued) counts in the model's recent
# outcomes, as those a worker ends do (common/fleet_stats.py).
_NOTE_OUTCOME = """
local function note_outcome(key, status, id, now_ms, window_ms)
  redis.call('ZADD', key, now_ms, status .. ':' .. id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - window_ms)
  redis.call('PEXPIRE', key, 2 * window_ms)
end
"""

# A job still waiting for its first attempt past its queue deadline fails as expired, in CLAIM (a worker
# reaches it at the head of its queue) and in EXPIRE_QUEUED (the gateways' sweep, which needs no worker).
# The caller has taken it out of its queue and its cost off the queued tokens.
_EXPIRE = """
local function past_deadline(rec, now)
  local deadline = tonumber(redis.call('HGET', rec, 'deadline_ms') or '0')
  return redis.call('HGET', rec, 'attempts') == '0' and redis.call('HGET', rec, 'status') == 'queued'
    and deadline > 0 and now > deadline
end
local function expire_in_queue(id, job, deadlines, outcomes, now, window_ms, code, noticed)
  local created = tonumber(redis.call('HGET', job.rec, 'created_at'))
  local waited = string.format('%.1f', (now - created * 1000) / 1000)
  local message = 'expired in queue: waited ' .. waited .. ' s, past the queue deadline'
  redis.call('HSET', job.rec, 'status', 'failed', 'finish_reason', 'error', 'error', message,
    'error_code', code, 'finished_at', now / 1000)
  redis.call('XADD', job.events, '*', 'type', 'error', 'status', 'failed', 'message', message,
    'code', code)
  noticed[#noticed + 1] = job.events
  redis.call('DEL', job.arq)
  leave_active(job.active, job.held, id)
  redis.call('ZREM', deadlines, id)
  note_outcome(outcomes, 'failed', id, now, window_ms)
end
"""

# Weighted fair share between keys within a priority class, by tokens: start-time fair queuing.
# A job's start tag S = max(V, F[key]), where V (':v') is the start tag of the class's last claimed job
# and F[key] the finish tag of the key's last job; the key's F becomes S + cost / weight. Tags count in
# 1/UNIT tokens; the queue's score is S * SEQ + a submission counter, so equal tags keep submission
# order. A key idle for a while starts at V again: it holds no credit. Scores stay exact doubles
# (below 2^53) for 2^43 / UNIT tokens of a class's virtual time.
_FAIR = """
local UNIT, SEQ = 8, 1024
local function num(x) return string.format('%.0f', x) end
local function fair_tag(tags, owner, cost, weight)
  local v = tonumber(redis.call('HGET', tags, ':v') or '0')
  local s = math.max(v, tonumber(redis.call('HGET', tags, owner) or '0'))
  redis.call('HSET', tags, owner, num(s + math.ceil(cost * UNIT / weight)))
  local seq = redis.call('HINCRBY', tags, ':seq', 1) % SEQ
  return num(s * SEQ + seq)
end
local function advance(tags, score)
  local s = math.floor(score / SEQ)
  if s > tonumber(redis.call('HGET', tags, ':v') or '0') then redis.call('HSET', tags, ':v', num(s)) end
end
"""

SUBMIT = (
    _PAIRS
    + _ACTIVE
    + _FAIR
    + """
-- KEYS: record, events, arq job, queue of its class, queued tokens, owner's active jobs, owner's jobs,
--       fair-share tags of its class, the Redis's epoch, queue deadlines, owner's prompt tokens in
--       flight, idempotency entry (only with an idempotency key)
-- ARGV: id, ttl_s, now_ms, max queued jobs, arq payload, wake channel, cost, max queued tokens,
--       owner's max active jobs (0: no limit), owner, weight, its prompt tokens (estimated), owner's max
--       prompt tokens in flight (0: no limit), n record fields, fields..., n event fields, fields...,
--       its queue deadline ms ('': none), the epoch the job id carries ('': not checked)
-- Returns {outcome, detail}: created/duplicate and the job id, busy, prompt_tokens and the prompt
-- tokens the owner's active jobs hold, full and which limit, or epoch when the Redis's epoch is not the
-- job id's (it lost its data since the caller read it). A job is over the prompt-token limit only when
-- the owner has some in flight: a lone prompt of any length is taken.
local epoch = ARGV[#ARGV]
if epoch ~= '' and redis.call('GET', KEYS[9]) ~= epoch then return {'epoch', ''} end
local idem = KEYS[12]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return {'duplicate', existing} end
end
local horizon = tonumber(ARGV[3]) - tonumber(ARGV[2]) * 1000
for _, stale in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', horizon)) do
  leave_active(KEYS[6], KEYS[11], stale)  -- its record expired long ago: nothing else ends it now
end
local max_active = tonumber(ARGV[9])
if max_active > 0 and redis.call('ZCARD', KEYS[6]) >= max_active then return {'busy', ''} end
local prompt, max_prompt = tonumber(ARGV[12]), tonumber(ARGV[13])
local holding = tonumber(redis.call('HGET', KEYS[11], ':total') or '0')
if max_prompt > 0 and holding > 0 and holding + prompt > max_prompt then
  return {'prompt_tokens', tostring(holding)}
end
if redis.call('ZCARD', KEYS[4]) >= tonumber(ARGV[4]) then return {'full', 'jobs'} end
local cost = tonumber(ARGV[7])
local queued = tonumber(redis.call('GET', KEYS[5]) or '0')
if queued > 0 and queued + cost > tonumber(ARGV[8]) then return {'full', 'tokens'} end
local ttl = tonumber(ARGV[2])
local rec, at = pairs_at(15)
local tag = fair_tag(KEYS[8], ARGV[10], cost, tonumber(ARGV[11]))
redis.call('EXPIRE', KEYS[8], ttl)
redis.call('HSET', KEYS[1], 'tag', tag, unpack(rec))
redis.call('EXPIRE', KEYS[1], ttl)
local ev = pairs_at(at + 1)
redis.call('XADD', KEYS[2], '*', unpack(ev))
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('SET', KEYS[3], ARGV[5], 'EX', ttl)
redis.call('ZADD', KEYS[4], tag, ARGV[1])
redis.call('EXPIRE', KEYS[4], ttl)  -- a queue outlives the record of every job in it
redis.call('INCRBY', KEYS[5], cost)
redis.call('EXPIRE', KEYS[5], ttl)
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[6], ttl)
redis.call('HSET', KEYS[11], ARGV[1], prompt)
redis.call('HINCRBY', KEYS[11], ':total', prompt)
redis.call('EXPIRE', KEYS[11], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', horizon)
redis.call('ZADD', KEYS[7], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[7], ttl)
if idem then redis.call('SET', idem, ARGV[1], 'EX', ttl) end
if ARGV[#ARGV - 1] ~= '' then
  redis.call('ZADD', KEYS[10], ARGV[#ARGV - 1], ARGV[1])
  redis.call('EXPIRE', KEYS[10], ttl)
end
redis.call('PUBLISH', ARGV[6], ARGV[1])
return {'created', ARGV[1]}
"""
)

CANCEL = (
    _PAIRS
    + _ACTIVE
    + _UNCOUNT
    + _NOTE_OUTCOME
    + """
-- KEYS: record, queue of its class, events, arq job, queued tokens, owner's active jobs,
--       model's recent outcomes, owner's prompt tokens in flight
-- ARGV: id, now_s, cancel channel, now_ms, outcome window ms, n event fields, fields..., stream notices
--       channel
-- Returns 'cancelled' (was queued), 'cancelling' (running: its worker is told), 'missing', or the
-- job's terminal status.
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'attempts') == '0' then uncount(KEYS[5], KEYS[1]) end
  leave_active(KEYS[6], KEYS[8], ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finish_reason', 'cancelled', 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[3], '*', unpack((pairs_at(7))))
  redis.call('PUBLISH', ARGV[#ARGV], KEYS[3])
  redis.call('DEL', KEYS[4])
  note_outcome(KEYS[7], 'cancelled', ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5]))
  return 'cancelled'
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return 'cancelling'
end
return st
"""
)

# The claim. Which job a worker takes next is decided by `claimable` alone: the head of the highest
# class that has waiting jobs, in each class's fair-share order. It must pick among the candidates it
# was given (the only jobs whose keys it holds); a wider choice needs JobQueue._claim_candidates to
# look further.
CLAIM = (
    _ACTIVE
    + _UNCOUNT
    + _NOTE_OUTCOME
    + _EXPIRE
    + _FAIR
    + """
-- KEYS: leases, queued tokens, model's recent outcomes, queue deadlines, then per class (highest first):
--       its queue, its fair-share tags; then 5 keys per candidate job: record, events, arq job, its
--       owner's active jobs, its owner's prompt tokens in flight
-- ARGV: now_ms, lease_ms, max jobs, worker id, outcome window ms, error code of an expired job,
--       idle ('1': the worker runs nothing, so it may take a suspect job, alone),
--       n classes, class names..., stream notices channel,
--       then per candidate: id, owner, whether the owner is known ('1'; else its owner's key is a
--       stand-in, not to be touched)
-- Candidates are the jobs the caller saw at the head of each class's queue and in leases that ran
-- out. Jobs whose lease ran out go back to their class's queue first, with the tag they had (they
-- keep their place), suspect: their worker died. Then jobs are taken from the head of the highest
-- class with waiting jobs while that head is a candidate. A suspect job is taken only by an idle
-- worker that took nothing else in this claim, and then alone: its attempt is quarantined. The
-- script stops, and says why, at the first that is not a candidate (the head moved since the caller
-- looked: 1), or that expired in the queue while the caller did not know its owner (2); the caller
-- looks again, then knowing every candidate's owner. It stops too at a suspect job it may not take,
-- and at a job whose preferred worker (the one that holds its prompt's KV) is another, until the job's
-- preferred_until_ms (3): that worker takes it meanwhile, or any worker after.
-- Returns {why it stopped early (0, 1 or 2), whether a suspect job waits for an idle worker ('1'/'0'),
-- then per claimed job: id, attempt, arq payload, owner, quarantined ('1'/'0'), deaths in quarantine}.
local now = tonumber(ARGV[1])
local idle = ARGV[7] == '1'
local nclass = tonumber(ARGV[8])
local queues, tags, class_at = {}, {}, {}
for c = 1, nclass do
  queues[c], tags[c] = KEYS[3 + 2 * c], KEYS[4 + 2 * c]
  class_at[ARGV[8 + c]] = c
end
local notices, noticed = ARGV[9 + nclass], {}
local candidates = {}
local n = 0
for i = 10 + nclass, #ARGV - 2, 3 do
  local k = 4 + 2 * nclass + 5 * n
  candidates[ARGV[i]] = {owner = ARGV[i + 1], known = ARGV[i + 2] == '1', rec = KEYS[k + 1],
    events = KEYS[k + 2], arq = KEYS[k + 3], active = KEYS[k + 4], held = KEYS[k + 5]}
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
  redis.call('XADD', job.events, '*', 'type', 'status', 'status', 'queued', 'reason', 'worker_lost',
    'attempt', attempt)
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

-- The next job to consider: the head of the highest class with waiting jobs, if the caller passed its
-- keys; with its class and score.
local function claimable()
  for c = 1, nclass do
    local head = redis.call('ZRANGE', queues[c], 0, 0, 'WITHSCORES')
    if #head > 0 then
      local job = candidates[head[1]]
      if not job or (job.known and (redis.call('HGET', job.rec, 'owner') or '') ~= job.owner) then
        return nil, true
      end
      return head[1], false, c, tonumber(head[2])
    end
  end
  return nil, false
end

requeue_expired_leases()
local out = {0, '0'}
local taken = 0
while taken < tonumber(ARGV[3]) do
  local id, moved, c, score = claimable()
  if not id then
    if moved then out[1] = 1 end
    break
  end
  local job = candidates[id]
  local suspect = redis.call('HGET', job.rec, 'suspect') == '1'
  if suspect and (taken > 0 or not idle) then
    out[2] = '1'
    break
  end
  local preferred = redis.call('HMGET', job.rec, 'preferred_worker', 'preferred_until_ms')
  if preferred[1] and preferred[1] ~= ARGV[4] and not suspect and now < tonumber(preferred[2] or '0') then
    out[1] = 3
    break
  end
  local st = redis.call('HGET', job.rec, 'status')
  local first = redis.call('HGET', job.rec, 'attempts') == '0'
  local expired = past_deadline(job.rec, now)
  if expired and not job.known then
    out[1] = 2
    break
  end
  redis.call('ZREM', queues[c], id)
  advance(tags[c], score)
  if first then
    uncount(KEYS[2], job.rec)
    redis.call('ZREM', KEYS[4], id)
  end
  if expired then
    expire_in_queue(id, job, KEYS[4], KEYS[3], now, tonumber(ARGV[5]), ARGV[6], noticed)
  elseif st == 'queued' or st == 'running' then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    local attempt = redis.call('HINCRBY', job.rec, 'attempts', 1)
    redis.call('HSET', job.rec, 'status', 'running', 'worker', ARGV[4], 'started_at', now / 1000)
    local payload = redis.call('GET', job.arq) or ''
    out[#out + 1] = id
    out[#out + 1] = attempt
    out[#out + 1] = payload
    out[#out + 1] = redis.call('HGET', job.rec, 'owner') or ''
    if suspect then redis.call('HSET', job.rec, 'quarantined_attempt', attempt) end
    out[#out + 1] = suspect and '1' or '0'
    out[#out + 1] = redis.call('HGET', job.rec, 'quarantine_deaths') or '0'
    taken = taken + 1
    if suspect then break end
  end
end
if #noticed > 0 then redis.call('PUBLISH', notices, table.concat(noticed, ' ')) end
return out
"""
)

EXPIRE_QUEUED = (
    _ACTIVE
    + _UNCOUNT
    + _NOTE_OUTCOME
    + _EXPIRE
    + """
-- KEYS: queue deadlines, queued tokens, model's recent outcomes, queue of its class, record, events,
--       arq job, owner's active jobs, owner's prompt tokens in flight
-- ARGV: id, now_ms, outcome window ms, error code of an expired job, owner, stream notices channel
-- The gateways' sweep of the queue deadlines, for jobs no worker claims (none is live): the job fails as
-- CLAIM fails it when still waiting for its first attempt past its deadline. A job that started, ended
-- or is gone leaves the deadlines; one whose owner is not the caller's (it read the record before a
-- purge and a new job) is left for the next sweep. Returns 1 when it expired the job, else 0.
local id, now = ARGV[1], tonumber(ARGV[2])
local job = {rec = KEYS[5], events = KEYS[6], arq = KEYS[7], active = KEYS[8], held = KEYS[9]}
if redis.call('EXISTS', job.rec) == 1 and (redis.call('HGET', job.rec, 'owner') or '') ~= ARGV[5] then
  return 0
end
if not past_deadline(job.rec, now) or redis.call('ZREM', KEYS[4], id) == 0 then
  redis.call('ZREM', KEYS[1], id)
  return 0
end
uncount(KEYS[2], job.rec)
local noticed = {}
expire_in_queue(id, job, KEYS[1], KEYS[3], now, tonumber(ARGV[3]), ARGV[4], noticed)
redis.call('PUBLISH', ARGV[6], table.concat(noticed, ' '))
return 1
"""
)

RESERVE_PREEMPTION = """
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
"""

RENEW = """
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
"""

PUBLISH = (
    _PAIRS
    + """
-- KEYS: record, events
-- ARGV: attempt, n record fields, fields..., n entries, then per entry: n fields, fields...,
--       stream notices channel
-- Returns the entries written, or -1 once the attempt lost the job.
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return -1 end
local rec, at = pairs_at(3)
if #rec > 0 then redis.call('HSET', KEYS[1], unpack(rec)) end
local written = 0
local next_at = at + 1
for _ = 1, tonumber(ARGV[at]) do
  local ev
  ev, next_at = pairs_at(next_at + 1)
  redis.call('XADD', KEYS[2], '*', unpack(ev))
  written = written + 1
end
if written > 0 then redis.call('PUBLISH', ARGV[#ARGV], KEYS[2]) end
return written
"""
)

# The writes of one engine step for all of a worker's running jobs, each fenced by its own attempt.
PUBLISH_STEP = """
-- KEYS: per job, in order: record, events
-- ARGV: per job: attempt, from, to, n record fields, fields..., n entries, then per entry: n fields,
--       fields...; last, the stream notices channel
--   from, to: the token index of the write's first token entry and the index past its last one ('' when
--   it has none, or when from must not be checked). The record's `streamed` says where the stream's
--   tokens end: a write that starts past it (the newest entries were lost, as in a failover to a replica
--   that had not received them) is refused whole, so that the worker writes the missing ones first.
-- Returns per job the entries written, -1 where the attempt no longer owns the job, -2 where the write
-- would leave a gap.
-- The notice names the streams written, and after a newline carries their new entries (see above).
local out = {}
local noticed, carried = {}, {}
local at = 1
for j = 1, #KEYS / 2 do
  local record, events = KEYS[2 * j - 1], KEYS[2 * j]
  local status = -1
  local streamed = 0
  local held = redis.call('HMGET', record, 'attempts', 'streamed')
  if held[1] == ARGV[at] then
    status = 0
    streamed = tonumber(held[2] or '0')
    if ARGV[at + 1] ~= '' and tonumber(ARGV[at + 1]) > streamed then status = -2 end
  end
  local writing = status == 0
  local to = ARGV[at + 2]
  local nrec = tonumber(ARGV[at + 3])
  local rec = {}
  if writing then
    for i = at + 4, at + 3 + 2 * nrec do rec[#rec + 1] = ARGV[i] end
    if to ~= '' and tonumber(to) > streamed then
      rec[#rec + 1] = 'streamed'
      rec[#rec + 1] = to
    end
  end
  at = at + 4 + 2 * nrec
  local entries = tonumber(ARGV[at])
  at = at + 1
  local written, added, after = 0, {}, '0-0'
  if writing and entries > 0 then
    local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)[1]
    if last then after = last[1] end
  end
  for _ = 1, entries do
    local n = tonumber(ARGV[at])
    if writing then
      local ev = {}
      for i = at + 1, at + 2 * n do ev[#ev + 1] = ARGV[i] end
      added[#added + 1] = {redis.call('XADD', events, '*', unpack(ev)), ev}
      written = written + 1
    end
    at = at + 1 + 2 * n
  end
  if #rec > 0 then redis.call('HSET', record, unpack(rec)) end
  out[j] = writing and written or status
  if writing and written > 0 then
    noticed[#noticed + 1] = events
    carried[#carried + 1] = {events, after, added}
  end
end
if #noticed > 0 then
  redis.call('PUBLISH', ARGV[#ARGV], table.concat(noticed, ' ') .. '\\n' .. cjson.encode(carried))
end
return out
"""

FINISH = (
    _PAIRS
    + _ACTIVE
    + _FAIR
    + """
-- KEYS: record, events, leases, arq job, owner's active jobs, fair-share tags of its class,
--       model's served tokens, owner's prompt tokens in flight
-- ARGV: attempt, id, ttl_s, tokens served (prompt and generated; -1: unknown), its class,
--       tokens the attempt streamed ('': not checked), n record fields, fields..., n event fields,
--       fields..., stream notices channel
-- Returns 1, 0 once the attempt lost the job, or 2 (nothing written) when the stream holds fewer
-- tokens than the attempt streamed (a failover lost the newest: the worker writes them again first).
-- The owner's finish tag is corrected by what the job really cost against its estimate (never
-- below the class's virtual time), and the tokens count in the served totals of its class and key.
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
if ARGV[6] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'streamed') or '0') < tonumber(ARGV[6]) then
  return 2
end
local served = tonumber(ARGV[4])
if served >= 0 then
  local owner = redis.call('HGET', KEYS[1], 'owner') or ''
  local class = ARGV[5]
  local f = tonumber(redis.call('HGET', KEYS[6], owner) or '')
  if f then
    local cost = tonumber(redis.call('HGET', KEYS[1], 'cost') or '0')
    local weight = tonumber(redis.call('HGET', KEYS[1], 'weight') or '1')
    local v = tonumber(redis.call('HGET', KEYS[6], ':v') or '0')
    redis.call('HSET', KEYS[6], owner, num(math.max(v, f + math.floor((served - cost) * UNIT / weight))))
  end
  redis.call('HINCRBY', KEYS[7], class, served)
  redis.call('HINCRBY', KEYS[7], class .. ':' .. owner, served)
  redis.call('EXPIRE', KEYS[7], ARGV[3])
end
local rec, at = pairs_at(8)
redis.call('HSET', KEYS[1], unpack(rec))
redis.call('XADD', KEYS[2], '*', unpack((pairs_at(at + 1))))
redis.call('PUBLISH', ARGV[#ARGV], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
leave_active(KEYS[5], KEYS[8], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

RELEASE = """
-- KEYS: queue of its class, leases, record; ARGV: id, attempt, preempted (1 or 0), behind (1 or 0)
-- Puts a job its attempt still holds back in its class's queue with the tag it had (its place), or,
-- behind: just after the job at the queue's head, for which it was preempted; a preempted job counts
-- the preemption, which is not an attempt. Returns 1, or 0 when the attempt no longer holds it (its
-- lease ran out and another worker may have claimed it since).
if redis.call('HGET', KEYS[3], 'attempts') ~= ARGV[2] then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  local place = tonumber(redis.call('HGET', KEYS[3], 'tag') or '0')
  if ARGV[4] == '1' then
    local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    if head[2] and tonumber(head[2]) >= place then place = tonumber(head[2]) + 1 end
  end
  redis.call('ZADD', KEYS[1], string.format('%.0f', place), ARGV[1])
  if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'preemptions', 1) end
  return 1
end
return 0
"""

PURGE = (
    _ACTIVE
    + _UNCOUNT
    + """
-- KEYS: record, events, arq job, queue of its class, leases, queued tokens, owner's active jobs,
--       owner's jobs, owner's prompt tokens in flight, idempotency entry (only when the record names one)
-- ARGV: id, cancel channel
-- Returns 1, or 0 when the job does not exist.
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
if redis.call('ZREM', KEYS[4], ARGV[1]) == 1 and redis.call('HGET', KEYS[1], 'attempts') == '0' then
  uncount(KEYS[6], KEYS[1])
end
leave_active(KEYS[7], KEYS[9], ARGV[1])
redis.call('ZREM', KEYS[8], ARGV[1])
local idem = KEYS[10]
if idem and redis.call('HGET', KEYS[1], 'idempotency_key') == idem then redis.call('DEL', idem) end
if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""
)
