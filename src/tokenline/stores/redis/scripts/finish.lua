-- finish.lua: apply finalising writes, each only if its token still holds the job.
--
-- KEYS[1]  the store's prefix; touches job:<id>, attempts:<id>, running, runn,
--          qp:<queue>:<prio>, prios:<queue>, wait:<queue>\t<task>, counts:<queue>,
--          st:<state>, ended:<kind>, stale, stale_n, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  number of finishes; then 10 per finish:
--          job id, owner, token, outcome (for the attempt and a refusal), next state,
--          delay ('' = keep run_at), attempts refunded, finished (0/1),
--          error (JSON), error class (JSON)
-- Returns  1 (applied) or 0 (refused, recorded as a stale write) per finish.
--
-- The next state is the core's finish_transition; the store only applies it under the
-- token check, so the rule lives once, in Python.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
local n = tonumber(ARGV[3])
local out = {}
for i = 0, n - 1 do
  local b = 4 + i * 10
  local id, owner, token, outcome = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3]
  local state, delay, refund = ARGV[b + 4], num(ARGV[b + 5]), tonumber(ARGV[b + 6])
  local err, err_class = opt(ARGV[b + 8]), opt(ARGV[b + 9])
  local h = job_head(id)
  if h == nil or h.state ~= 'running' or h.token + BASE ~= token or h.owner ~= owner then
    record_stale(id, token, owner, outcome, now)
    table.insert(out, 0)
  else
    local key = job_key(id)
    local run_at = tonumber(redis.call('HGET', key, 'run_at'))
    if delay ~= nil then run_at = now + delay end
    if refund ~= 0 then redis.call('HINCRBY', key, 'attempt', f(-refund)) end
    redis.call('HSET', key, 'state', state, 'run_at', f(run_at), 'updated_at', f(now))
    redis.call('HDEL', key, 'lease_owner', 'lease_expires_at')
    hset_opt(key, 'last_error', err)
    hset_opt(key, 'error_class', err_class)
    if ARGV[b + 7] == '1' then
      redis.call('HSET', key, 'finished_at', f(now))
    else
      redis.call('HDEL', key, 'finished_at')
    end
    run_del(id, h.queue, h.task)
    set_state(id, h.queue, 'running', state, now)
    if state == 'queued' or state == 'scheduled' then
      wait_add(id, h.queue, h.task, h.priority, run_at)
    end
    close_attempt(id, h.token, outcome, err, err_class, now)
    table.insert(out, 1)
  end
end
return out
