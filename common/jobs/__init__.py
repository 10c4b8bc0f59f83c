"""The job state machine in Redis: every transition is one JobQueue method and one atomic Lua script.

A model has one queue per priority class (common.wire.PRIORITY_ORDER): a sorted set of job ids scored
by a fair-share tag (start-time fair queuing by tokens between keys, weighted per key; see
scripts/fair.lua). A worker claims from the highest class with waiting jobs, moving the job to the
model's lease set, scored by the lease's expiry; its heartbeat pushes that expiry forward. A lease
that runs out (the worker died) puts the job back in its queue with its tag, where any worker of the
model resumes it; so does a batch job preempted for interactive work. Writes to a job's stream and
record are fenced by the attempt number, so a worker that lost its lease can never write into the job
again.

The scripts (scripts/*.lua, loaded by common/lua.py) receive every key they touch in KEYS, derived in
common/keys.py by their typed wrappers; no script builds a key name. The record's fields and their
encoding are record.py's; the job itself is stored in arq's format (payload.py).

A script that adds entries to job streams publishes their keys, space-separated, on the stream
notices channel (its last ARGV; CLAIM's after the class names) in one message: each gateway's relay
reads just the streams it is told of (gateway/streaming/relay.py). The step write, which carries nearly
all of a stream's entries, adds after a newline the entries themselves, as JSON: per stream `[key, the
id of the entry before them, [[id, [field, value, ...]], ...]]`, which a relay hands out without reading
them back. A reader of the keys alone (split on whitespace) still finds every stream it follows.

Modules: queue.py (JobQueue), submission.py, cancellation.py (cancel, purge, queue deadlines),
claims.py (claims and leases), writes.py (a worker's writes and the job's end), reads.py, record.py,
payload.py.
"""
