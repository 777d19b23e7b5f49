-- prune_fill.lua: one batch of filling the retention index (ended:<kind>) with the jobs
-- that reached a final state before the index existed, fenced by the leader's term.
--
-- KEYS[1]  the store's prefix; touches ended:<kind>, ended_fill; reads st:<state>,
--          job:<id>, rl:<leader lease>, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none);
-- ARGV[3]  the maintenance lease's name, ARGV[4] its owner, ARGV[5] its token;
-- ARGV[6]  the most jobs to read
-- Returns  1 once every such job is indexed (ended_fill's ``done``), else 0: call again.
--          The error TLLEADER, having changed nothing, for a deposed leader.
--
-- Walks st:<state> of each final state by id, from where the last batch stopped
-- (ended_fill holds the last id per state). Jobs that end from now on are indexed by
-- set_state; ZADD NX leaves their entries as they are, so a batch can be run again.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
check_leader(ARGV[3], ARGV[4], ARGV[5], now)
local fill = P .. 'ended_fill'
if redis.call('HGET', fill, 'done') == '1' then return 1 end
local left = tonumber(ARGV[6])
for _, state in ipairs({'succeeded', 'cancelled', 'dead'}) do
  local after = redis.call('HGET', fill, state) or '0'
  local ids = redis.call('ZRANGEBYSCORE', P .. 'st:' .. state, '(' .. after, '+inf',
                         'LIMIT', 0, left)
  for _, id in ipairs(ids) do
    local v = redis.call('HMGET', job_key(id), 'finished_at', 'updated_at')
    local at = num(v[1]) or num(v[2]) or now
    redis.call('ZADD', P .. 'ended:' .. ENDED[state], 'NX', f(at), id)
  end
  if #ids > 0 then redis.call('HSET', fill, state, ids[#ids]) end
  left = left - #ids
  if left <= 0 then return 0 end
end
redis.call('HSET', fill, 'done', '1')
return 1
