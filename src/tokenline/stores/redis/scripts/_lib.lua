-- _lib.lua: helpers prepended to every script of this directory; not run on its own.
--
-- KEYS[1] of every script is the store's key prefix, ``{name}:`` (one hash tag, so a
-- Redis Cluster keeps all of a store's keys in one slot). Every key a script touches
-- starts with it; each script's header lists the ones it touches, by suffix:
--
--   job:<id>            hash: one job, fields named as tokenline's Job
--   attempts:<id>       list: the job's attempts, JSON objects, oldest first
--   seq                 string: the last job id issued
--   qp:<queue>:<prio>   zset: waiting jobs of one queue and priority, score run_at,
--                       member the zero-padded id (equal run_at: lowest id first)
--   prios:<queue>       zset: the priorities that have waiting jobs in a queue
--   wait:<queue>\t<task> zset: waiting jobs per queue and task, score run_at (depth)
--   runn                hash: running jobs per "<queue>\t<task>"
--   running             zset: running jobs, score the lease expiry (rescue)
--   counts:<queue>      hash: jobs per stored state
--   st:<state>          zset: jobs in a state, score the id (listing)
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

local function set_state(id, queue, old, new)
  if old == new then return end
  if old ~= nil and old ~= '' then
    redis.call('HINCRBY', P .. 'counts:' .. queue, old, -1)
    redis.call('ZREM', P .. 'st:' .. old, id)
  end
  redis.call('HINCRBY', P .. 'counts:' .. queue, new, 1)
  redis.call('ZADD', P .. 'st:' .. new, id, id)
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

-- The job's fields a check needs, or nil for no such job.
local function job_head(id)
  local v = redis.call('HMGET', job_key(id), 'state', 'lease_token', 'lease_owner',
                       'lease_expires_at', 'queue', 'task', 'priority')
  if not v[1] then return nil end
  return {state = v[1], token = tonumber(v[2]), owner = v[3] or '',
          expires = num(v[4]), queue = v[5], task = v[6], priority = v[7]}
end

-- The fencing epoch (see the ``epoch`` module of this package): ``expected`` is the
-- epoch the caller's store holds ('' for a store without an epoch source). Raises
-- TLEPOCH when this server is not the one that epoch was issued for — its replication
-- id changed (a promoted replica, a restarted primary) or it never got one — so the
-- caller takes a new epoch before any token is issued or checked here.
--
-- Tokens handed out are ``epoch * 2^32 + counter``: the job and lease hashes keep the
-- counter; BASE is what a script adds to compare with, or return, a caller's token.
local BASE = 0
local function check_epoch(expected)
  if expected == '' then return end
  BASE = tonumber(expected) * 4294967296
  local cur = redis.call('MGET', P .. 'epoch', P .. 'epoch_replid')
  local info = redis.call('INFO', 'replication')
  local replid = string.match(info, 'master_replid:(%w+)')
  if cur[1] ~= expected or cur[2] ~= replid then
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
