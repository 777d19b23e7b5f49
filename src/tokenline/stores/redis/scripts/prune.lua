-- prune.lua: one batch of retention: delete jobs of one prune kind that finished before
-- a time, with everything they occupy, fenced by the leader's term.
--
-- KEYS[1]  the store's prefix; touches ended:<kind>, job:<id>, attempts:<id>,
--          st:<state>, counts:<queue>, all, uniq:<key>, pruned; reads rl:<leader lease>,
--          epoch, epoch_replid; a job whose hash is missing or malformed goes through
--          drop_job (dropped, dropped_n, bad:<id>, its other indexes)
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name, ARGV[4] its owner, ARGV[5] its token;
-- ARGV[6]  the kind: 'finished' (succeeded, cancelled) or 'dead';  ARGV[7] before
--          (epoch seconds);  ARGV[8] the most jobs to delete;  ARGV[9] 1 to note each
--          pruned id in ``pruned`` for a ledger to hear of (the split store), else 0
-- Returns  the ids deleted, oldest finished first; the error TLLEADER, having changed
--          nothing, when the caller no longer holds the maintenance lease.
--
-- The jobs come from the ended:<kind> index, never from a scan of every job. Each is
-- checked again against its own hash (a final state of this kind, finished before
-- ``before``): a job that is queued, scheduled or running is never touched, whatever
-- the index says. A job in a final state is in no waiting or running index (set_state,
-- wait_del and run_del took it out), so its hash, attempts, state index, count and
-- ``all`` are all it occupies; its unique key goes only if it keeps nothing out any
-- more (held while active, or its unique_for is over): a key held for good stays.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)
local kind, before, limit, note = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local index = P .. 'ended:' .. kind

local function release_key(id, ikey)
  if not ikey then return end
  local uk = P .. 'uniq:' .. ikey
  local u = redis.call('HMGET', uk, 'job', 'active', 'until')
  local untl = num(u[3])
  if u[1] == id and (u[2] == '1' or (untl ~= nil and untl <= now)) then
    redis.call('DEL', uk)
  end
end

local out = {}
local ids = redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. f(before), 'LIMIT', 0, limit)
for _, id in ipairs(ids) do
  local h, why = job_head(id)
  if h == nil then
    drop_job(id, nil, why, now)  -- gone or malformed: out of every index, recorded
  elseif ENDED[h.state] == kind and h.finished ~= nil and h.finished < before then
    release_key(id, redis.call('HGET', job_key(id), 'idempotency_key'))
    redis.call('DEL', job_key(id), P .. 'attempts:' .. id)
    redis.call('HINCRBY', P .. 'counts:' .. h.queue, h.state, -1)
    redis.call('ZREM', P .. 'st:' .. h.state, id)
    redis.call('ZREM', P .. 'all', id)
    redis.call('ZREM', index, id)
    if note == '1' then redis.call('ZADD', P .. 'pruned', f(now), id) end
    table.insert(out, id)
  elseif ENDED[h.state] == kind and h.finished ~= nil then
    redis.call('ZADD', index, f(h.finished), id)  -- scored apart from its hash: mended
  else
    redis.call('ZREM', index, id)  -- no longer of this kind
  end
end
return out
