-- rescue_scan.lua: the running jobs whose lease has expired by the store's clock.
--
-- KEYS[1]  the store's prefix; reads running, job:<id>
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the most to return
-- Returns  {now, then 7 per job: id, token, owner, attempt, max_attempts,
--          lease_expiries, max_lease_expiries}. Read only: rescue_apply.lua moves each
--          job, conditional on the token read here.
local now = now_of(ARGV[1])
local out = {f(now)}
local ids = redis.call('ZRANGEBYSCORE', P .. 'running', '-inf', f(now), 'LIMIT', 0,
                       tonumber(ARGV[2]))
for _, m in ipairs(ids) do
  local id = tonumber(m)
  local v = redis.call('HMGET', job_key(id), 'lease_token', 'lease_owner', 'attempt',
                       'max_attempts', 'lease_expiries', 'max_lease_expiries')
  table.insert(out, id)
  for j = 1, 6 do table.insert(out, v[j] or '') end
end
return out
