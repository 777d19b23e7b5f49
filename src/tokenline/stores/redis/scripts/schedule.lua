-- schedule.lua: a periodic schedule's high-water mark, moved forwards together with the
-- enqueue of the job of that instant, fenced by the leader's term.
--
-- KEYS[1]  the store's prefix; touches sched, seq, job:<id>, qp:<queue>:<prio>,
--          prios:<queue>, wait:<queue>\t<task>, counts:<queue>, st:<state>, all,
--          queues, pairs, uniq:<key>; reads rl:<leader lease>, epoch, epoch_replid
--          (sched: hash, each schedule's mark, epoch seconds)
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name, ARGV[4] its owner, ARGV[5] its token;
-- ARGV[6]  the schedule's name;  ARGV[7] the instant;  ARGV[8] 1 with a job, 0 without;
--          then the job's 12 arguments, as enqueue.lua takes them (its unique key is
--          taken as there: a key held by an unfinished job enqueues nothing more)
-- Returns  1 when the mark moved to the instant (and the job was enqueued), 0 when the
--          mark was already at or past it (nothing written); the error TLLEADER,
--          having changed nothing, when the caller no longer holds the maintenance lease.
--
-- Why no instant runs twice: the mark only moves forwards, in the same atomic script
-- as the enqueue of its instant (see maintenance/scheduler.py).
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)
local name, instant = ARGV[6], tonumber(ARGV[7])
local mark = num(redis.call('HGET', P .. 'sched', name))
if mark ~= nil and mark >= instant then return 0 end  -- mark
redis.call('HSET', P .. 'sched', name, f(instant))
if ARGV[8] ~= '1' then return 1 end

local b = 9
local queue, task, args = ARGV[b], ARGV[b + 1], ARGV[b + 2]
local ikey = opt(ARGV[b + 3])
local prio = ARGV[b + 4]
local unique, unique_for = ARGV[b + 10], num(ARGV[b + 11])
local finished = {succeeded = true, dead = true, cancelled = true}
if unique ~= '' then
  local held = redis.call('HMGET', P .. 'uniq:' .. ikey, 'job', 'until', 'active')
  if held[1] then
    local released = false
    local untl = num(held[2])
    if untl ~= nil and untl <= now then released = true end
    if held[3] == '1' then
      local st = redis.call('HGET', job_key(held[1]), 'state')
      if st and finished[st] then released = true end
    end
    if not released then return 1 end
  end
end
local id = redis.call('INCR', P .. 'seq')
local run_at = num(ARGV[b + 5])
if run_at == nil then run_at = now + (num(ARGV[b + 6]) or 0) end
local state = 'queued'
if run_at > now then state = 'scheduled' end
local key = job_key(id)
if unique ~= '' then
  local uk = P .. 'uniq:' .. ikey
  redis.call('DEL', uk)
  redis.call('HSET', uk, 'job', id, 'active', unique == 'active' and '1' or '0')
  if unique_for ~= nil then redis.call('HSET', uk, 'until', f(now + unique_for)) end
end
redis.call('HSET', key, 'id', id, 'queue', queue, 'task', task, 'args', args,
           'priority', prio, 'run_at', f(run_at), 'attempt', 0,
           'max_attempts', ARGV[b + 7], 'state', state, 'lease_token', 0,
           'created_at', f(now), 'updated_at', f(now), 'lease_expiries', 0,
           'max_lease_expiries', ARGV[b + 9])
hset_opt(key, 'idempotency_key', ikey)
if ARGV[b + 8] ~= '' then redis.call('HSET', key, 'timeout', ARGV[b + 8]) end
set_state(id, queue, nil, state)
redis.call('ZADD', P .. 'all', id, id)
redis.call('SADD', P .. 'queues', queue)
redis.call('SADD', P .. 'pairs', queue .. '\t' .. task)
wait_add(id, queue, task, prio, run_at)
return 1
