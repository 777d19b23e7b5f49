-- worker.lua: worker membership leases, each write conditional on the membership token.
--
-- KEYS[1]  the store's prefix; touches w:<id>, workers
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] action;  ARGV[3] worker id
--   register:   ARGV[4] ttl, ARGV[5] host, ARGV[6] pid, ARGV[7] queues (JSON),
--               ARGV[8] concurrency, ARGV[9] state, ARGV[10] concurrency limit ('' none)
--               → a fresh token (one above the last), the membership restarts
--   heartbeat:  ARGV[4] ttl, ARGV[5] token, ARGV[6] state, ARGV[7] in flight,
--               ARGV[8] skew ('' = keep), ARGV[9] concurrency limit ('' = keep)
--               → extends only a held, unexpired membership
--   deregister: ARGV[4] token → marks the membership stopped, if the token holds it
--   drain:      → marks a live membership as asked to drain
-- Returns  {now, the worker's hash as a flat field list} ({now} when refused).
local now = now_of(ARGV[1])
local action, id = ARGV[2], ARGV[3]
local key = P .. 'w:' .. id
local cur = redis.call('HMGET', key, 'token', 'expires_at', 'state')
local token, expires, state = tonumber(cur[1]), num(cur[2]), cur[3]
local ok = false
if action == 'register' then
  local ttl = tonumber(ARGV[4])
  -- drain_requested kept on a re-registration: an operator's drain, asked before the
  -- process re-registered (fenced, or its membership lapsed while paused), still holds.
  if not cur[1] then redis.call('HSET', key, 'started_at', f(now), 'drain_requested', 0) end
  redis.call('HSET', key, 'id', id, 'host', ARGV[5], 'pid', ARGV[6], 'queues', ARGV[7],
             'concurrency', ARGV[8], 'state', ARGV[9], 'token', (token or 0) + 1,
             'heartbeat_at', f(now), 'expires_at', f(now + ttl), 'in_flight', 0)
  redis.call('HDEL', key, 'clock_skew')
  hset_opt(key, 'concurrency_limit', num(ARGV[10]))
  redis.call('SADD', P .. 'workers', id)
  ok = true
elseif action == 'heartbeat' then
  if token ~= nil and token == tonumber(ARGV[5]) and expires > now then
    redis.call('HSET', key, 'state', ARGV[6], 'in_flight', ARGV[7], 'heartbeat_at', f(now),
               'expires_at', f(now + tonumber(ARGV[4])))
    if ARGV[8] ~= '' then redis.call('HSET', key, 'clock_skew', ARGV[8]) end
    if ARGV[9] ~= '' then redis.call('HSET', key, 'concurrency_limit', ARGV[9]) end
    ok = true
  end
elseif action == 'deregister' then
  if token ~= nil and token == tonumber(ARGV[4]) then
    redis.call('HSET', key, 'state', 'stopped', 'in_flight', 0, 'heartbeat_at', f(now),
               'expires_at', f(now))
    ok = true
  end
elseif action == 'drain' then
  if token ~= nil and state ~= 'stopped' and expires > now then
    redis.call('HSET', key, 'drain_requested', 1)
    ok = true
  end
end
if ok then return {f(now), redis.call('HGETALL', key)} end
return {f(now)}
