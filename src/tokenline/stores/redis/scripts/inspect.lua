-- inspect.lua: read-only views: queue statistics, depth, and job listings.
--
-- KEYS[1]  the store's prefix; reads queues, paused, counts:<queue>, prios:<queue>,
--          qp:<queue>:<prio>, pairs, wait:<queue>\t<task>, runn, st:<state>, all,
--          job:<id>
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] 'stats', 'depth' or 'list'
-- Returns  by view:
--   stats: returns {now, per queue: name, paused (0/1), counts (flat hash), oldest
--          runnable run_at ('' = none)}
--   depth: returns {now, per queue and task: "<queue>\t<task>", runnable, scheduled,
--          running}
--   list:  ARGV[3] state ('' = any), ARGV[4] queue ('' = any), ARGV[5] limit,
--          ARGV[6] the most bytes of args to return ('' = all; cut at a character's
--          start, a payload may be megabytes); returns {now, then 2 per job, newest
--          first: its id, its hash's flat field list}. A job the index names whose hash is missing comes with an empty
--          list (with any queue asked for), so that the caller can name it; a
--          malformed hash comes as it is: the caller checks every field.
local now = now_of(ARGV[1])
local out = {f(now)}
local what = ARGV[2]
if what == 'stats' then
  local names = redis.call('SUNION', P .. 'queues', P .. 'paused')
  for _, q in ipairs(names) do
    local oldest = nil
    for _, prio in ipairs(redis.call('ZRANGE', P .. 'prios:' .. q, 0, -1)) do
      local r = redis.call('ZRANGEBYSCORE', P .. 'qp:' .. q .. ':' .. prio, '-inf', f(now),
                           'WITHSCORES', 'LIMIT', 0, 1)
      if #r > 0 and (oldest == nil or tonumber(r[2]) < oldest) then oldest = tonumber(r[2]) end
    end
    table.insert(out, q)
    table.insert(out, redis.call('SISMEMBER', P .. 'paused', q))
    table.insert(out, redis.call('HGETALL', P .. 'counts:' .. q))
    table.insert(out, f(oldest))
  end
elseif what == 'depth' then
  for _, pair in ipairs(redis.call('SMEMBERS', P .. 'pairs')) do
    local w = P .. 'wait:' .. pair
    table.insert(out, pair)
    table.insert(out, redis.call('ZCOUNT', w, '-inf', f(now)))
    table.insert(out, redis.call('ZCOUNT', w, '(' .. f(now), '+inf'))
    table.insert(out, tonumber(redis.call('HGET', P .. 'runn', pair) or '0'))
  end
elseif what == 'list' then
  local state, queue, limit = ARGV[3], ARGV[4], tonumber(ARGV[5])
  local cut = tonumber(ARGV[6] or '')
  local index = P .. 'all'
  if state ~= '' then index = P .. 'st:' .. state end
  local start = 0
  local found = 0
  while found < limit do
    local ids = redis.call('ZREVRANGE', index, start, start + 499)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      local h = redis.call('HGETALL', job_key(id))
      local q = redis.call('HGET', job_key(id), 'queue')
      if found < limit and (queue == '' or q == queue or #h == 0) then
        if cut ~= nil then
          for i = 1, #h - 1, 2 do
            if h[i] == 'args' and #h[i + 1] > cut then
              -- Back to the start of a UTF-8 character: never half of one.
              local n = cut
              while n > 0 and string.byte(h[i + 1], n + 1) >= 0x80
                  and string.byte(h[i + 1], n + 1) < 0xC0 do
                n = n - 1
              end
              h[i + 1] = string.sub(h[i + 1], 1, n)
            end
          end
        end
        table.insert(out, id)
        table.insert(out, h)
        found = found + 1
      end
    end
    start = start + 500
  end
end
return out
