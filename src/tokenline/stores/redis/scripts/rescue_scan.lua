-- rescue_scan.lua: the running jobs whose lease has expired by the store's clock.
--
-- KEYS[1]  the store's prefix; reads running, job:<id>; when a job's hash is missing or
--          malformed, touches what drop_job does (dropped, dropped_n, bad:<id>, the
--          job's indexes and counts)
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the most to return
-- Returns  {now, dropped, then 7 per job: id, token, owner, attempt, max_attempts,
--          lease_expiries, max_lease_expiries}. dropped is a flat list of the job id and
--          the key named for each job taken out of every index because its hash was
--          missing or malformed (see drop_job). Otherwise read only: rescue_apply.lua
--          moves each job, conditional on the token read here.
--
-- Why it drops: an entry of ``running`` whose hash is gone can never be rescued, and
-- left there it would come back first in every scan, before the jobs behind it.
local now = now_of(ARGV[1])
local dropped = {}
local out = {f(now), dropped}
local ids = redis.call('ZRANGEBYSCORE', P .. 'running', '-inf', f(now), 'LIMIT', 0,
                       tonumber(ARGV[2]))
for _, m in ipairs(ids) do
  local id = tonumber(m)
  local h, why = job_head(id)
  if h == nil then
    table.insert(dropped, tostring(id))
    table.insert(dropped, drop_job(id, nil, why, now))
  elseif h.state ~= 'running' then
    -- An entry left behind by a job that no longer runs: only the entry goes.
    redis.call('ZREM', P .. 'running', m)
  else
    for _, v in ipairs({id, f(h.token), h.owner, f(h.attempt), f(h.max_attempts),
                        f(h.lease_expiries), f(h.max_lease_expiries)}) do
      table.insert(out, v)
    end
  end
end
return out
