-- reconcile_scan.lua: one batch of the reconciler's read of the jobs Redis holds.
--
-- KEYS[1]  the store's prefix; reads all, job:<id>, attempts:<id>, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the last job id of the previous batch (0 to start);  ARGV[4] the batch size
-- Returns  {now, the last job id read ('' when no job is left), then 4 per finding:
--          kind, job id, token (epoch included), state or owner}. Read only. Kinds:
--   unfinished  a job that ran (token > 0) and is queued, scheduled, or running on an
--               expired lease, with its state: the caller asks the ledger whether its
--               work committed (reconcile_apply.lua's ``ack`` acknowledges it)
--   open        an attempt without an outcome whose job no longer runs under its
--               token, with the attempt's token and owner (``attempt`` closes it)
--
-- A batch reads at most ARGV[4] jobs, so that no call holds Redis up for long.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
local size = tonumber(ARGV[4])
local ids = redis.call('ZRANGEBYSCORE', P .. 'all', '(' .. ARGV[3], '+inf', 'LIMIT', 0, size)
local out = {f(now), #ids == size and ids[#ids] or ''}
local waiting = {queued = true, scheduled = true}
for _, id in ipairs(ids) do
  local h = job_head(id)
  if h ~= nil and h.token > 0 then
    local live = h.state == 'running' and h.expires ~= nil and h.expires > now
    if waiting[h.state] or (h.state == 'running' and not live) then
      for _, v in ipairs({'unfinished', id, f(h.token + BASE), h.state}) do
        table.insert(out, v)
      end
    end
    for _, raw in ipairs(redis.call('LRANGE', P .. 'attempts:' .. id, 0, -1)) do
      local a = cjson.decode(raw)
      if a.finished_at == cjson.null
         and not (h.state == 'running' and a.counter == f(h.token)) then
        for _, v in ipairs({'open', id, a.token, a.owner}) do table.insert(out, v) end
      end
    end
  end
end
return out
