-- prune_audit.lua: one batch of retention of an audit list (refused stale writes, or
-- refused renewals of named leases), fenced by the leader's term; or, read only, how
-- many entries a prune would take.
--
-- KEYS[1]  the store's prefix; touches stale, stale_n, rl_stale; reads
--          rl:<leader lease>, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  'prune' or 'count' (nothing written, no leader needed);
-- ARGV[4]  the maintenance lease's name, ARGV[5] its owner, ARGV[6] its token;
-- ARGV[7]  the list: 'stale' or 'rl_stale';  ARGV[8] before (epoch seconds);
-- ARGV[9]  the most entries to delete
-- Returns  how many entries were deleted (or would be); the error TLLEADER, having
--          changed nothing, when the caller no longer holds the maintenance lease.
--
-- Both lists are pushed newest first, each entry with its ``at``, and trimmed to 10000
-- entries: the old ones are at the tail, taken one by one while older than ``before``.
-- ``stale_n`` (the total stale_commits reports) goes down by those taken from ``stale``.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
local mode, list, before = ARGV[3], P .. ARGV[7], tonumber(ARGV[8])
if ARGV[7] ~= 'stale' and ARGV[7] ~= 'rl_stale' then
  error(redis.error_reply('ERR not an audit list: ' .. ARGV[7]))
end
if mode == 'count' then
  local n = 0
  local items = redis.call('LRANGE', list, 0, -1)
  for i = #items, 1, -1 do
    if tonumber(cjson.decode(items[i]).at) >= before then break end
    n = n + 1
  end
  return n
end
check_leader(ARGV[4], ARGV[5], ARGV[6], now)
local n, limit = 0, tonumber(ARGV[9])
while n < limit do
  local last = redis.call('LINDEX', list, -1)
  if not last or tonumber(cjson.decode(last).at) >= before then break end
  redis.call('RPOP', list)
  n = n + 1
end
if ARGV[7] == 'stale' and n > 0 then
  local left = tonumber(redis.call('GET', P .. 'stale_n') or '0') - n
  redis.call('SET', P .. 'stale_n', math.max(left, 0))
end
return n
