-- rescue_apply.lua: return expired jobs to the queue (or dead-letter them), bumping
-- each job's token so the worker that lost it can never match again.
--
-- KEYS[1]  the store's prefix; touches job:<id>, attempts:<id>, running, runn,
--          qp:<queue>:<prio>, prios:<queue>, wait:<queue>\t<task>, counts:<queue>,
--          st:<state>, ended:<kind>; reads rl:<leader lease>, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name ('' = an unfenced pass), ARGV[4] its owner,
--          ARGV[5] its token: the caller's term as leader; then 5 per job: id, token
--          read by rescue_scan.lua, next state (queued | dead), attempts refunded, reason
-- Returns  per job 1 (moved) or 0 (no longer running under that token, or renewed
--          since: left alone); the error TLLEADER, having changed nothing, when the
--          caller no longer holds the maintenance lease (a newer leader exists).
--
-- The next state is the core's rescue_transition, computed between the two scripts;
-- this one applies it only while the job still runs, expired, under the token read.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)
local out = {}
for i = 6, #ARGV, 5 do
  local id, token, state = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local refund, reason = tonumber(ARGV[i + 3]), ARGV[i + 4]
  local h = job_head(id)
  if h == nil or h.state ~= 'running' or h.token ~= token or h.expires == nil
     or h.expires > now then
    table.insert(out, 0)
  else
    local key = job_key(id)
    close_attempt(id, token, 'lease_expired', reason, 'coordination', now)
    if refund ~= 0 then redis.call('HINCRBY', key, 'attempt', f(-refund)) end
    redis.call('HINCRBY', key, 'lease_expiries', 1)
    redis.call('HSET', key, 'state', state, 'lease_token', token + 1, 'last_error', reason,
               'error_class', 'coordination', 'updated_at', f(now))
    redis.call('HDEL', key, 'lease_owner', 'lease_expires_at')
    run_del(id, h.queue, h.task)
    set_state(id, h.queue, 'running', state, now)
    if state == 'dead' then
      redis.call('HSET', key, 'finished_at', f(now))
    else
      local run_at = tonumber(redis.call('HGET', key, 'run_at'))
      wait_add(id, h.queue, h.task, h.priority, run_at)
    end
    table.insert(out, 1)
  end
end
return out
