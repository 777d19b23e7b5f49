-- enqueue.lua: insert a batch of jobs, all in one atomic step.
--
-- KEYS[1]  the store's prefix; touches seq, job:<id>, attempts:<id> (none yet),
--          qp:<queue>:<prio>, prios:<queue>, wait:<queue>\t<task>, counts:<queue>,
--          st:<state>, all, queues, pairs, uniq:<key>; reads epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME)
-- ARGV[2]  the epoch the store holds ('' = none): ids are drawn only on the server that
--          epoch was issued for (TLEPOCH otherwise, nothing written), so a promoted
--          replica that lost the last enqueues never hands out one of their ids again
-- ARGV[3]  number of jobs; then 12 arguments per job: queue, task, args (JSON text),
--          idempotency key (JSON: null or text), priority, run_at ('' = none),
--          delay ('' = none), max_attempts, timeout ('' = none), max_lease_expiries,
--          unique ('' | 'always' | 'active'), unique_for ('' = none)
-- Returns  the job ids, in order; a unique job whose key is held returns the holder's id.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
local n = tonumber(ARGV[3])
local ids = {}
for i = 0, n - 1 do
  local id = enqueue_job(4 + i * 12, now)
  table.insert(ids, id)
end
return ids
