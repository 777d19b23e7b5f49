-- enqueue.lua: insert a batch of jobs, all in one atomic step.
--
-- KEYS[1]  the store's prefix; touches seq, job:<id>, attempts:<id> (none yet),
--          qp:<queue>:<prio>, prios:<queue>, wait:<queue>\t<task>, counts:<queue>,
--          st:<state>, all, queues, pairs, uniq:<key>
-- ARGV[1]  now ('' = Redis TIME)
-- ARGV[2]  number of jobs; then 12 arguments per job: queue, task, args (JSON text),
--          idempotency key (JSON: null or text), priority, run_at ('' = none),
--          delay ('' = none), max_attempts, timeout ('' = none), max_lease_expiries,
--          unique ('' | 'always' | 'active'), unique_for ('' = none)
-- Returns  the job ids, in order; a unique job whose key is held returns the holder's id.
local now = now_of(ARGV[1])
local n = tonumber(ARGV[2])
local ids = {}
local finished = {succeeded = true, dead = true, cancelled = true}
for i = 0, n - 1 do
  local b = 3 + i * 12
  local queue, task, args = ARGV[b], ARGV[b + 1], ARGV[b + 2]
  local ikey = opt(ARGV[b + 3])
  local prio = ARGV[b + 4]
  local unique, unique_for = ARGV[b + 10], num(ARGV[b + 11])
  local holder = nil
  if unique ~= '' then
    local uk = P .. 'uniq:' .. ikey
    local held = redis.call('HMGET', uk, 'job', 'until', 'active')
    if held[1] then
      local released = false
      local untl = num(held[2])
      if untl ~= nil and untl <= now then released = true end
      if held[3] == '1' then
        local st = redis.call('HGET', job_key(held[1]), 'state')
        if st and finished[st] then released = true end
      end
      if not released then holder = tonumber(held[1]) end
    end
  end
  if holder ~= nil then
    table.insert(ids, holder)
  else
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
    table.insert(ids, id)
  end
end
return ids
