-- _lib.lua: helpers prepended to every script of this directory; not run on its own.
--
-- KEYS[1] of every script is the store's key prefix, ``{name}:`` (one hash tag, so a
-- Redis Cluster keeps all of a store's keys in one slot). Every key a script touches
-- starts with it; each script's header lists the ones it touches, by suffix:
--
--   job:<id>            hash: one job, fields named as tokenline's Job
--   attempts:<id>       list: the job's attempts, JSON objects, oldest first
--   seq                 string: the last job id issued (at least epoch * 2^32
--                       under an epoch: see epoch.lua)
--   qp:<queue>:<prio>   zset: waiting jobs of one queue and priority, score run_at,
--                       member the zero-padded id (equal run_at: lowest id first)
--   prios:<queue>       zset: the priorities that have waiting jobs in a queue
--   wait:<queue>\t<task> zset: waiting jobs per queue and task, score run_at (depth)
--   runn                hash: running jobs per "<queue>\t<task>"
--   running             zset: running jobs, score the lease expiry (rescue)
--   counts:<queue>      hash: jobs per stored state
--   st:<state>          zset: jobs in a state, score the id (listing)
--   ended:<kind>        zset: jobs in a final state, by prune kind (finished: succeeded
--                       and cancelled; dead), score the finished_at (retention)
--   ended_fill          hash: how far the index of jobs that ended before it existed
--                       was filled (see prune_fill.lua)
--   pruned              zset: pruned jobs a ledger has yet to hear of (split topology),
--                       score when pruned
--   all                 zset: every job, score the id
--   queues              set: every queue that ever held a job
--   pairs               set: every "<queue>\t<task>" that ever held a job
--   paused              set: paused queues
--   uniq:<key>          hash: the job holding a unique idempotency key
--   stale / stale_n     list (JSON, newest first) / counter: refused stale writes
--   w:<id>, workers     hash per worker membership / set of worker ids
--   rl:<name>, rls      hash per named lease / set of lease names
--   rl_stale            list: refused renewals of named leases (JSON, newest first)
--   epoch               string: the fencing epoch this server's tokens carry
--   dropped / dropped_n list (JSON, newest first) / counter: jobs taken out of every
--                       index because their hash was missing or malformed (drop_job)
--   bad:<id>            hash: a malformed job hash, moved aside by drop_job
--
-- Times are epoch seconds from Redis's own clock (TIME); ARGV[1] replaces it only when
-- the store was built with an explicit clock (tests). Numbers are written with 17
-- significant digits: Lua's default (14) would round timestamps.
local P = KEYS[1]

local function now_of(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function f(x)
  if x == nil then return '' end
  if math.floor(x) == x and math.abs(x) < 2 ^ 53 then return string.format('%.0f', x) end
  return string.format('%.17g', x)
end

local function pad(id) return string.format('%015d', tonumber(id)) end

local function num(v)
  if v == false or v == nil or v == '' then return nil end
  return tonumber(v)
end

local function job_key(id) return P .. 'job:' .. id end

-- The prune kind of each final state: its jobs wait in ended:<kind> for retention.
local ENDED = {succeeded = 'finished', cancelled = 'finished', dead = 'dead'}

-- Move a job between the state indexes. ``at`` is when it reached ``new``: for a final
-- state, the finished_at its caller writes, which scores it in ended:<kind>. Every move
-- into or out of a final state goes through here, so the retention index is never
-- behind the job's state.
local function set_state(id, queue, old, new, at)
  if old == new then return end
  if old ~= nil and old ~= '' then
    redis.call('HINCRBY', P .. 'counts:' .. queue, old, -1)
    redis.call('ZREM', P .. 'st:' .. old, id)
    if ENDED[old] then redis.call('ZREM', P .. 'ended:' .. ENDED[old], id) end
  end
  redis.call('HINCRBY', P .. 'counts:' .. queue, new, 1)
  redis.call('ZADD', P .. 'st:' .. new, id, id)
  if ENDED[new] then redis.call('ZADD', P .. 'ended:' .. ENDED[new], f(at), id) end
end

local function wait_add(id, queue, task, prio, run_at)
  redis.call('ZADD', P .. 'qp:' .. queue .. ':' .. prio, f(run_at), pad(id))
  redis.call('ZADD', P .. 'prios:' .. queue, prio, prio)
  redis.call('ZADD', P .. 'wait:' .. queue .. '\t' .. task, f(run_at), pad(id))
end

local function wait_del(id, queue, task, prio)
  local qp = P .. 'qp:' .. queue .. ':' .. prio
  redis.call('ZREM', qp, pad(id))
  if redis.call('ZCARD', qp) == 0 then redis.call('ZREM', P .. 'prios:' .. queue, prio) end
  redis.call('ZREM', P .. 'wait:' .. queue .. '\t' .. task, pad(id))
end

local function run_add(id, queue, task, expires)
  redis.call('ZADD', P .. 'running', f(expires), pad(id))
  redis.call('HINCRBY', P .. 'runn', queue .. '\t' .. task, 1)
end

local function run_del(id, queue, task)
  redis.call('ZREM', P .. 'running', pad(id))
  redis.call('HINCRBY', P .. 'runn', queue .. '\t' .. task, -1)
end

local function record_stale(id, token, owner, operation, now)
  local rec = cjson.encode({job_id = tostring(id), token = f(token), owner = owner,
                            operation = operation, at = f(now)})
  redis.call('LPUSH', P .. 'stale', rec)
  redis.call('LTRIM', P .. 'stale', 0, 9999)
  redis.call('INCR', P .. 'stale_n')
end

-- Close the job's open attempt whose token carries the counter ``token``.
local function close_attempt(id, token, outcome, err, err_class, now)
  local key = P .. 'attempts:' .. id
  local items = redis.call('LRANGE', key, 0, -1)
  for i = #items, 1, -1 do
    local a = cjson.decode(items[i])
    if a.counter == f(token) and a.finished_at == cjson.null then
      a.finished_at = f(now)
      a.outcome = outcome
      a.error = err == nil and cjson.null or err
      a.error_class = err_class == nil and cjson.null or err_class
      redis.call('LSET', key, i - 1, cjson.encode(a))
      return
    end
  end
end

-- A nullable text argument, sent as JSON (``null`` or a string).
local function opt(arg)
  local v = cjson.decode(arg)
  if v == cjson.null then return nil end
  return v
end

-- Set a nullable hash field: ``nil`` removes it (read back as None).
local function hset_opt(key, field, value)
  if value == nil then redis.call('HDEL', key, field) else redis.call('HSET', key, field, value) end
end

-- Redis with an eviction policy, or an operator's DEL, can remove a job's hash while
-- the indexes still name it, or leave a field that is not what the scripts wrote. A
-- script that wrote with such a value would fail halfway, and Redis keeps a failed
-- script's earlier writes: so every job is read through job_head, which checks each
-- field tokenline relies on (here and in RedisStore._job) before anything is written.
local STATES = {scheduled = true, queued = true, running = true, succeeded = true,
                dead = true, cancelled = true}

local function is_int(v)
  return type(v) == 'string' and string.match(v, '^%-?%d+$') ~= nil
end

-- Hexadecimal is refused: Lua reads it, Python's float() does not.
local function is_num(v)
  return type(v) == 'string' and tonumber(v) ~= nil and not string.find(v, '[xX]')
end

local JOB_FIELDS = {'id', 'queue', 'task', 'args', 'priority', 'run_at', 'attempt',
                    'max_attempts', 'state', 'lease_token', 'created_at', 'updated_at',
                    'lease_expiries', 'max_lease_expiries', 'lease_owner',
                    'lease_expires_at', 'finished_at', 'timeout'}
local INT_FIELDS = {'priority', 'attempt', 'max_attempts', 'lease_token', 'lease_expiries',
                    'max_lease_expiries'}
local NUM_FIELDS = {'run_at', 'created_at', 'updated_at'}
local OPT_NUM_FIELDS = {'lease_expires_at', 'finished_at', 'timeout'}

-- The job's fields a check needs, or nil and why (missing, or the first bad field).
local function job_head(id)
  local v = redis.call('HMGET', job_key(id), unpack(JOB_FIELDS))
  local h = {}
  for i, name in ipairs(JOB_FIELDS) do h[name] = v[i] end
  if not h.id and not h.state then
    if redis.call('EXISTS', job_key(id)) == 0 then return nil, 'missing' end
  end
  if not is_int(h.id) or tonumber(h.id) ~= tonumber(id) then return nil, 'bad id' end
  if not h.queue or h.queue == '' then return nil, 'bad queue' end
  if not h.task or h.task == '' then return nil, 'bad task' end
  if not h.args then return nil, 'bad args' end
  if not STATES[h.state] then return nil, 'bad state' end
  for _, name in ipairs(INT_FIELDS) do
    if not is_int(h[name]) then return nil, 'bad ' .. name end
  end
  for _, name in ipairs(NUM_FIELDS) do
    if not is_num(h[name]) then return nil, 'bad ' .. name end
  end
  for _, name in ipairs(OPT_NUM_FIELDS) do
    if h[name] and h[name] ~= '' and not is_num(h[name]) then return nil, 'bad ' .. name end
  end
  return {state = h.state, token = tonumber(h.lease_token), owner = h.lease_owner or '',
          expires = num(h.lease_expires_at), queue = h.queue, task = h.task,
          priority = h.priority, run_at = tonumber(h.run_at), attempt = tonumber(h.attempt),
          max_attempts = tonumber(h.max_attempts),
          lease_expiries = tonumber(h.lease_expiries),
          max_lease_expiries = tonumber(h.max_lease_expiries),
          finished = num(h.finished_at)}
end

-- Take job ``id``, whose hash job_head refused (``why``), out of every index, so that
-- no claim, rescue or listing meets it again: it cannot run (its payload is gone or
-- untrustworthy). ``queue`` is the queue it was found in (nil when unknown: then the
-- hash's own, if it has one). A malformed hash is moved aside to bad:<id> for the
-- operator. Counters a missing hash no longer tells us how to correct (per queue and
-- task, for a job that was running) stay as they are. Each drop is recorded in
-- ``dropped`` and ``dropped_n`` and in the Redis server's log; returns the key named.
local function drop_job(id, queue, why, now)
  id = tonumber(id)
  local key = job_key(id)
  local v = redis.call('HMGET', key, 'queue', 'task')
  if not queue and v[1] and v[1] ~= '' then queue = v[1] end
  local task = v[2]
  if queue then
    for _, prio in ipairs(redis.call('ZRANGE', P .. 'prios:' .. queue, 0, -1)) do
      local qp = P .. 'qp:' .. queue .. ':' .. prio
      if redis.call('ZREM', qp, pad(id)) == 1 and redis.call('ZCARD', qp) == 0 then
        redis.call('ZREM', P .. 'prios:' .. queue, prio)
      end
    end
    local head = queue .. '\t'
    for _, pair in ipairs(redis.call('SMEMBERS', P .. 'pairs')) do
      if string.sub(pair, 1, #head) == head then
        redis.call('ZREM', P .. 'wait:' .. pair, pad(id))
      end
    end
  end
  if redis.call('ZREM', P .. 'running', pad(id)) == 1 and queue and task then
    redis.call('HINCRBY', P .. 'runn', queue .. '\t' .. task, -1)
  end
  for state in pairs(STATES) do
    if redis.call('ZREM', P .. 'st:' .. state, id) == 1 and queue then
      redis.call('HINCRBY', P .. 'counts:' .. queue, state, -1)
    end
  end
  redis.call('ZREM', P .. 'ended:finished', id)
  redis.call('ZREM', P .. 'ended:dead', id)
  redis.call('ZREM', P .. 'all', id)
  local named = key
  if why ~= 'missing' then
    named = P .. 'bad:' .. id
    redis.call('RENAME', key, named)
  end
  redis.call('LPUSH', P .. 'dropped', cjson.encode({job_id = tostring(id), key = named,
                                                    reason = why, at = f(now)}))
  redis.call('LTRIM', P .. 'dropped', 0, 9999)
  redis.call('INCR', P .. 'dropped_n')
  redis.log(redis.LOG_WARNING, 'tokenline: job ' .. id .. ' taken out of every index: ' ..
            'its hash ' .. key .. ' is ' .. (why == 'missing' and 'missing' or
            'malformed (' .. why .. '), moved to ' .. named))
  return named
end

-- The identity an epoch is issued for: the server's replication id (it changes when a
-- replica is promoted or a primary restarts) and this prefix's incarnation, a random
-- value the store sets when it finds none. A FLUSHDB, keys deleted or a server that
-- came back empty take the incarnation with the ids and tokens: the next epoch is
-- then issued for a new identity, above every one before.
local function server_identity(incarnation)
  local info = redis.call('INFO', 'replication')
  return string.match(info, 'master_replid:(%w+)') .. '/' .. (incarnation or '')
end

-- The fencing epoch (see the ``epoch`` module of this package): ``expected`` is the
-- epoch the caller's store holds ('' for a store without an epoch source). Raises
-- TLEPOCH when this server is not the one that epoch was issued for — its identity
-- changed (a promoted replica, a restarted primary, its keys lost) or it never got
-- one — so the caller takes a new epoch before any token is issued or checked here.
-- The job id sequence gone while the epoch is still recorded (the key deleted or
-- evicted alone) is a loss too: the incarnation goes with it, so that the new epoch
-- is a new one and raises the sequence above every id issued before.
--
-- ``expected`` may name the ledger that issued the epoch (``epoch/ledger id``): epochs
-- are numbered by each ledger, so another ledger's epoch recorded here (the prefix's
-- keys lost, and taken by a process of another app) can carry the same number; it
-- must not pass for this ledger's.
--
-- Tokens handed out are ``epoch * 2^32 + counter``: the job and lease hashes keep the
-- counter; BASE is what a script adds to compare with, or return, a caller's token.
local BASE = 0
local function check_epoch(expected)
  if expected == '' then return end
  local number, ledger = string.match(expected, '^(%d+)/(.+)$')
  number = number or expected
  BASE = tonumber(number) * 4294967296
  local cur = redis.call('MGET', P .. 'epoch', P .. 'epoch_replid', P .. 'incarnation',
                         P .. 'seq', P .. 'epoch_ledger')
  if cur[1] and not cur[4] then
    redis.call('DEL', P .. 'incarnation')
    cur[3] = false
  end
  if cur[1] ~= number or cur[2] ~= server_identity(cur[3])
     or (ledger ~= nil and cur[5] ~= ledger) then
    error(redis.error_reply('TLEPOCH this Redis server holds epoch ' .. tostring(cur[1]) ..
                            ', the store expected ' .. expected))
  end
end

-- The maintenance leader's fence, after check_epoch: raises TLLEADER, before anything is
-- written, unless the named lease ``name`` is held by ``owner`` with ``token`` (the
-- caller's term, epoch included) unexpired at ``now``. ``name`` '' is an unfenced call.
local function check_leader(name, owner, token, now)
  if name == '' then return end
  local l = redis.call('HMGET', P .. 'rl:' .. name, 'owner', 'token', 'expires_at')
  if l[1] ~= owner or tonumber(l[2]) == nil or tonumber(l[2]) + BASE ~= tonumber(token)
     or num(l[3]) <= now then
    error(redis.error_reply('TLLEADER the maintenance lease is no longer ' .. owner ..
                            "'s with token " .. token))
  end
end

-- Insert the one job whose 12 enqueue arguments start at ARGV[b] (see enqueue.lua),
-- unless its unique key is held. Returns the new job's id and true, or the holder's id
-- and false. Callers have run check_epoch first: the id is drawn from ``seq``, which a
-- new epoch has raised above every id issued under the epochs before.
local ENQUEUE_FINISHED = {succeeded = true, dead = true, cancelled = true}
local function enqueue_job(b, now)
  local queue, task, args = ARGV[b], ARGV[b + 1], ARGV[b + 2]
  local ikey = opt(ARGV[b + 3])
  local prio = ARGV[b + 4]
  local unique, unique_for = ARGV[b + 10], num(ARGV[b + 11])
  if unique ~= '' then
    local held = redis.call('HMGET', P .. 'uniq:' .. ikey, 'job', 'until', 'active')
    if held[1] then
      local released = false
      local untl = num(held[2])
      if untl ~= nil and untl <= now then released = true end
      if held[3] == '1' then
        local st = redis.call('HGET', job_key(held[1]), 'state')
        -- A holder whose hash is gone (see drop_job) keeps nothing out either.
        if not st or ENQUEUE_FINISHED[st] then released = true end
      end
      if not released then return tonumber(held[1]), false end
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
  set_state(id, queue, nil, state, now)
  redis.call('ZADD', P .. 'all', id, id)
  redis.call('SADD', P .. 'queues', queue)
  redis.call('SADD', P .. 'pairs', queue .. '\t' .. task)
  wait_add(id, queue, task, prio, run_at)
  return id, true
end
