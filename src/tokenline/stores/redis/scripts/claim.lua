-- claim.lua: lease up to ``limit`` ready jobs of unpaused queues to one owner.
--
-- KEYS[1]  the store's prefix; touches paused, prios:<queue>, qp:<queue>:<prio>,
--          wait:<queue>\t<task>, job:<id>, attempts:<id>, running, runn,
--          counts:<queue>, st:<state>, epoch, epoch_replid; when a job's hash is
--          missing or malformed, what drop_job touches (dropped, dropped_n, bad:<id>,
--          pairs, all, ended:<kind>)
-- ARGV[1]  now ('' = Redis TIME)
-- ARGV[2]  owner;  ARGV[3] limit;  ARGV[4] ttl (seconds)
-- ARGV[5]  priority aging in seconds ('' = none)
-- ARGV[6]  the epoch the store holds ('' = none; see check_epoch)
-- ARGV[7…] the queues
-- Returns  {now, dropped, job…}: dropped a flat list of the job id and the key named for
--          each job taken out of every index because its hash was missing or malformed
--          (it is skipped, the next candidate taken instead); then each job claimed as
--          the flat field list of its hash, in claim order (highest effective priority,
--          then oldest run_at, then lowest id).
--
-- Reads at most ``limit`` jobs per queue and priority: within one priority the oldest
-- run_at ranks first whatever the aging, so a level's first ``limit`` dominate its rest.
local now = now_of(ARGV[1])
local owner, limit, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local aging = num(ARGV[5])
check_epoch(ARGV[6])
local cands = {}
for q = 7, #ARGV do
  local queue = ARGV[q]
  if redis.call('SISMEMBER', P .. 'paused', queue) == 0 then
    local prios = redis.call('ZREVRANGE', P .. 'prios:' .. queue, 0, -1)
    local found = 0
    for _, prio in ipairs(prios) do
      if aging == nil and found >= limit then break end
      local rows = redis.call('ZRANGEBYSCORE', P .. 'qp:' .. queue .. ':' .. prio, '-inf',
                              f(now), 'WITHSCORES', 'LIMIT', 0, limit)
      for i = 1, #rows, 2 do
        local run_at = tonumber(rows[i + 1])
        local eff = tonumber(prio)
        if aging ~= nil and run_at < now then eff = eff + math.floor((now - run_at) / aging) end
        table.insert(cands, {eff = eff, run_at = run_at, id = tonumber(rows[i]), prio = prio,
                             queue = queue})
        found = found + 1
      end
    end
  end
end
table.sort(cands, function(a, b)
  if a.eff ~= b.eff then return a.eff > b.eff end
  if a.run_at ~= b.run_at then return a.run_at < b.run_at end
  return a.id < b.id
end)
local dropped = {}
local out = {f(now), dropped}
local taken = 0
for i = 1, #cands do
  if taken >= limit then break end
  local id = cands[i].id
  local key = job_key(id)
  -- Checked before any write for this job: a bad hash is dropped, never half-claimed.
  local h, why = job_head(id)
  if h == nil then
    table.insert(dropped, tostring(id))
    table.insert(dropped, drop_job(id, cands[i].queue, why, now))
  elseif h.state ~= 'queued' and h.state ~= 'scheduled' then
    -- An entry left behind by a job that no longer waits: only the entry goes.
    redis.call('ZREM', P .. 'qp:' .. cands[i].queue .. ':' .. cands[i].prio, pad(id))
  else
    taken = taken + 1
    local token = h.token + 1
    local attempt = redis.call('HINCRBY', key, 'attempt', 1)
    redis.call('HSET', key, 'state', 'running', 'lease_owner', owner, 'lease_token', token,
               'lease_expires_at', f(now + ttl), 'updated_at', f(now))
    wait_del(id, h.queue, h.task, h.priority)
    set_state(id, h.queue, h.state, 'running', now)
    run_add(id, h.queue, h.task, now + ttl)
    redis.call('RPUSH', P .. 'attempts:' .. id, cjson.encode({
      attempt = f(attempt), token = f(token + BASE), counter = f(token), owner = owner,
      started_at = f(now), finished_at = cjson.null, outcome = cjson.null,
      error = cjson.null, error_class = cjson.null}))
    table.insert(out, redis.call('HGETALL', key))
  end
end
return out
