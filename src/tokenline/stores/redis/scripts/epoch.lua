-- epoch.lua: record the fencing epoch issued for this server, and raise the job id
-- sequence to that epoch's floor.
--
-- KEYS[1]  the store's prefix; touches epoch, epoch_replid, seq; reads incarnation
-- ARGV[1]  the epoch (a whole number >= 0) the ledger issued for this server's
--          identity;  ARGV[2] that identity (see server_identity in _lib.lua);
--          ARGV[3] the ledger's own id ('' none), which check_epoch compares too
-- Returns  the job id sequence after the raise.
--
-- Why ids are never handed out twice: a new epoch is issued whenever the server's
-- identity changes (a promoted replica, a restarted primary, its keys lost), the only
-- ways it can have lost ids it issued. ``seq`` is raised to epoch * 2^32, above every
-- id issued under an earlier epoch (each issues fewer than 2^32), before the epoch is
-- recorded: enqueue.lua draws ids only once check_epoch finds it recorded. Without
-- this, the ledger could hold a lost job's completion under an id a new job then gets,
-- and the new job would be acknowledged as done without running. ``seq`` is written
-- even at epoch 0: check_epoch takes its absence for a loss.
if server_identity(redis.call('GET', P .. 'incarnation')) ~= ARGV[2] then
  -- The identity changed since the caller read it (its keys were lost meanwhile).
  error(redis.error_reply('TLEPOCH this Redis server is no longer ' .. ARGV[2]))
end
local epoch = tonumber(ARGV[1])
local floor = epoch * 4294967296
local seq = tonumber(redis.call('GET', P .. 'seq') or '-1')
if seq < floor then
  seq = floor
  redis.call('SET', P .. 'seq', f(floor))
end
redis.call('MSET', P .. 'epoch', ARGV[1], P .. 'epoch_replid', ARGV[2],
           P .. 'epoch_ledger', ARGV[3] or '')
return seq
