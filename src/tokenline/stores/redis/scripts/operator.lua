-- operator.lua: an operator's action on a list of jobs: retry dead ones or cancel.
--
-- KEYS[1]  the store's prefix; touches job:<id>, qp:<queue>:<prio>, prios:<queue>,
--          wait:<queue>\t<task>, counts:<queue>, st:<state>, ended:<kind>
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] 'retry_dead' or 'cancel';
-- ARGV[3]  the cancel reason;  ARGV[4…] job ids
-- Returns  how many jobs moved. retry_dead moves dead jobs to queued with a fresh
--          budget (the token is kept: the next claim bumps it); cancel moves queued,
--          scheduled and dead jobs to cancelled. Nothing else moves.
local now = now_of(ARGV[1])
local action, reason = ARGV[2], ARGV[3]
local moved = 0
for i = 4, #ARGV do
  local id = ARGV[i]
  local h = job_head(id)
  if h ~= nil then
    local key = job_key(id)
    if action == 'retry_dead' and h.state == 'dead' then
      redis.call('HSET', key, 'state', 'queued', 'attempt', 0, 'lease_expiries', 0,
                 'run_at', f(now), 'updated_at', f(now))
      redis.call('HDEL', key, 'finished_at')
      set_state(id, h.queue, 'dead', 'queued', now)
      wait_add(id, h.queue, h.task, h.priority, now)
      moved = moved + 1
    elseif action == 'cancel' and (h.state == 'queued' or h.state == 'scheduled'
                                   or h.state == 'dead') then
      if h.state ~= 'dead' then wait_del(id, h.queue, h.task, h.priority) end
      redis.call('HSET', key, 'state', 'cancelled', 'last_error', reason,
                 'finished_at', f(now), 'updated_at', f(now))
      redis.call('HDEL', key, 'error_class')  -- the reason is the operator's, of no class
      set_state(id, h.queue, h.state, 'cancelled', now)
      moved = moved + 1
    end
  end
end
return moved
