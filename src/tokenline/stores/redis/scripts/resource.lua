-- resource.lua: named leases (maintenance leadership, business resources) with
-- monotonic tokens; the token survives a release, so the next holder's is higher.
--
-- KEYS[1]  the store's prefix; touches rl:<name>, rls, rl_stale, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] action;  ARGV[3] lease name;
-- ARGV[4]  the epoch the store holds ('' = none; see check_epoch); then, from ARGV[5]:
--   acquire: owner, ttl → take a free or expired lease (new token),
--            or extend it for the owner that holds it; refused while another holds it
--   renew:   owner, token, ttl → extend only while
--            (owner, token) holds it unexpired; a refusal under another token is
--            recorded in rl_stale
--   release: owner, token → expire it now, only for its holder
--   held:    owner, token → nothing written: whether (owner, token) holds it unexpired
-- Returns  {now, the lease's hash as a flat field list} ({now} when refused).
local now = now_of(ARGV[1])
local action, name = ARGV[2], ARGV[3]
local key = P .. 'rl:' .. name
local cur = redis.call('HMGET', key, 'owner', 'token', 'expires_at')
local owner, token, expires = cur[1], tonumber(cur[2]), num(cur[3])
check_epoch(ARGV[4])
local ok = false
if action == 'acquire' then
  local who, ttl = ARGV[5], tonumber(ARGV[6])
  if owner and expires > now and owner ~= who then
    ok = false
  elseif owner and owner == who and expires > now then
    redis.call('HSET', key, 'expires_at', f(now + ttl))
    ok = true
  else
    redis.call('HSET', key, 'owner', who, 'token', (token or 0) + 1,
               'expires_at', f(now + ttl), 'acquired_at', f(now))
    redis.call('SADD', P .. 'rls', name)
    ok = true
  end
elseif action == 'renew' then
  local who, tok, ttl = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
  if owner and owner == who and token + BASE == tok and expires > now then
    redis.call('HSET', key, 'expires_at', f(now + ttl))
    ok = true
  elseif owner and token + BASE ~= tok then
    redis.call('LPUSH', P .. 'rl_stale', cjson.encode({resource = name, token = tostring(tok),
                                                      owner = who, at = f(now)}))
    redis.call('LTRIM', P .. 'rl_stale', 0, 9999)
  end
elseif action == 'held' then
  ok = owner ~= false and owner == ARGV[5] and token + BASE == tonumber(ARGV[6])
       and expires > now
elseif action == 'release' then
  if owner and owner == ARGV[5] and token + BASE == tonumber(ARGV[6]) then
    redis.call('HSET', key, 'expires_at', f(now))
    ok = true
  end
end
if ok then return {f(now), redis.call('HGETALL', key)} end
return {f(now)}
