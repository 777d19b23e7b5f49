-- reconcile_apply.lua: the reconciler's repairs on Redis, fenced by the leader's term,
-- each applied only while what it repairs is still as it was seen.
--
-- KEYS[1]  the store's prefix; touches job:<id>, attempts:<id>, running, runn,
--          qp:<queue>:<prio>, prios:<queue>, wait:<queue>\t<task>, counts:<queue>,
--          st:<state>, ended:<kind>, rl:<name>; reads w:<id>, rl:<leader lease>,
--          epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name, ARGV[4] its owner, ARGV[5] its token: the
--          caller's term as leader;  ARGV[6], ARGV[7] the outcome and error of an
--          attempt closed by ``ack``;  ARGV[8], ARGV[9] those of one closed by
--          ``attempt``; then 4 per repair: action, job id or lease name, token seen
--          (epoch included), state or owner seen:
--   ack      a job whose work the ledger holds committed: if still running on an
--            expired lease under the token seen, it succeeds and its attempt is closed;
--            if still queued or scheduled under it, it is taken off the queue with a
--            new token (so no earlier holder matches), then succeeds
--   lease    a named lease held, unexpired, by the owner and token seen, whose owner's
--            worker membership is over (stopped or expired): its token is bumped and
--            it expires now (never a delete: the counter must survive). The owner is
--            the worker's id, or a job attempt's '<worker id>/job<id>/t<token>'
--   attempt  the job's attempt with the token seen, still without an outcome, while
--            the job does not run under it: closed as lost
-- Returns  per repair 1 (applied) or 0 (changed since it was seen: left alone); the
--          error TLLEADER, having changed nothing, when the caller no longer holds
--          the maintenance lease (a newer leader exists).
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)

local function acknowledge(id, token, seen)
  local h = job_head(id)
  if h == nil or h.state ~= seen or h.token + BASE ~= token then return 0 end
  local key = job_key(id)
  if seen == 'running' then
    if h.expires ~= nil and h.expires > now then return 0 end
    run_del(id, h.queue, h.task)
    close_attempt(id, h.token, ARGV[6], ARGV[7], 'coordination', now)
  elseif seen == 'queued' or seen == 'scheduled' then
    wait_del(id, h.queue, h.task, h.priority)
    redis.call('HSET', key, 'lease_token', h.token + 1)
  else
    return 0
  end
  redis.call('HSET', key, 'state', 'succeeded', 'updated_at', f(now), 'finished_at', f(now))
  redis.call('HDEL', key, 'lease_owner', 'lease_expires_at')
  set_state(id, h.queue, seen, 'succeeded', now)
  return 1
end

-- The worker that holds a lease as `owner`: the worker of that id, else the one whose
-- job attempt it is. A worker id may hold '/': only the last two parts are the
-- attempt's, and the greedy capture leaves exactly the worker's id (no pattern is built
-- from the id).
local function holder_of(owner)
  if redis.call('EXISTS', P .. 'w:' .. owner) == 1 then return owner end
  return string.match(owner, '^(.*)/job%d+/t%d+$')
end

local function expire_orphan(name, token, owner)
  local key = P .. 'rl:' .. name
  local l = redis.call('HMGET', key, 'owner', 'token', 'expires_at')
  if l[1] ~= owner or tonumber(l[2]) + BASE ~= token or num(l[3]) <= now then return 0 end
  local worker = holder_of(owner)
  if not worker then return 0 end
  local w = redis.call('HMGET', P .. 'w:' .. worker, 'state', 'expires_at')
  if not w[1] or (w[1] ~= 'stopped' and num(w[2]) > now) then return 0 end
  redis.call('HSET', key, 'token', tonumber(l[2]) + 1, 'expires_at', f(now))
  return 1
end

local function close_open(id, token)
  local h = job_head(id)
  if h == nil then return 0 end
  local key = P .. 'attempts:' .. id
  local items = redis.call('LRANGE', key, 0, -1)
  for i = #items, 1, -1 do
    local a = cjson.decode(items[i])
    if a.token == token and a.finished_at == cjson.null then
      if h.state == 'running' and a.counter == f(h.token) then return 0 end
      a.finished_at = f(now)
      a.outcome = ARGV[8]
      a.error = ARGV[9]
      a.error_class = 'coordination'
      redis.call('LSET', key, i - 1, cjson.encode(a))
      return 1
    end
  end
  return 0
end

local out = {}
for i = 10, #ARGV, 4 do
  local action, what, token, seen = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local done = 0
  if action == 'ack' then
    done = acknowledge(what, tonumber(token), seen)
  elseif action == 'lease' then
    done = expire_orphan(what, tonumber(token), seen)
  elseif action == 'attempt' then
    done = close_open(what, token)
  end
  table.insert(out, done)
end
return out
