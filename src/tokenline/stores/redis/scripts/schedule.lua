-- schedule.lua: a periodic schedule's high-water mark, moved forwards together with the
-- enqueue of the job of that instant, fenced by the leader's term.
--
-- KEYS[1]  the store's prefix; touches sched, seq, job:<id>, qp:<queue>:<prio>,
--          prios:<queue>, wait:<queue>\t<task>, counts:<queue>, st:<state>, all,
--          queues, pairs, uniq:<key>; reads rl:<leader lease>, epoch, epoch_replid
--          (sched: hash, each schedule's mark, epoch seconds)
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name, ARGV[4] its owner, ARGV[5] its token;
-- ARGV[6]  the schedule's name;  ARGV[7] the instant;  ARGV[8] 1 with a job, 0 without;
--          then the job's 12 arguments, as enqueue.lua takes them (its unique key is
--          taken as there: a key held by an unfinished job enqueues nothing more)
-- Returns  1 when the mark moved to the instant (and the job was enqueued), 0 when the
--          mark was already at or past it (nothing written); the error TLLEADER,
--          having changed nothing, when the caller no longer holds the maintenance lease.
--
-- Why no instant runs twice: the mark only moves forwards, in the same atomic script
-- as the enqueue of its instant (see maintenance/scheduler.py).
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)
local name, instant = ARGV[6], tonumber(ARGV[7])
local mark = num(redis.call('HGET', P .. 'sched', name))
if mark ~= nil and mark >= instant then return 0 end  -- mark
redis.call('HSET', P .. 'sched', name, f(instant))
if ARGV[8] ~= '1' then return 1 end

enqueue_job(9, now)
return 1
