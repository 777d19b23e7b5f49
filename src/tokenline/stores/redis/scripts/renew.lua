-- renew.lua: extend the job leases still held (same owner and token, unexpired).
--
-- KEYS[1]  the store's prefix; touches job:<id>, running, stale, stale_n, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the renewing owner;  ARGV[3] ttl
-- ARGV[4]  the epoch the store holds ('' = none; see check_epoch)
-- ARGV[5…] triples: job id, token, the lease's owner
-- Returns  {now, expiry or '' per lease}: '' for a lease that is lost. A renewal refused
--          because another token or owner holds the job is recorded as a stale write.
local now = now_of(ARGV[1])
local owner, ttl = ARGV[2], tonumber(ARGV[3])
check_epoch(ARGV[4])
local out = {f(now)}
for i = 5, #ARGV, 3 do
  local id, token, lowner = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local h = job_head(id)
  if h ~= nil and lowner == owner and h.state == 'running' and h.token + BASE == token
     and h.owner == lowner and h.expires ~= nil and h.expires > now then
    redis.call('HSET', job_key(id), 'lease_expires_at', f(now + ttl), 'updated_at', f(now))
    redis.call('ZADD', P .. 'running', f(now + ttl), pad(id))
    table.insert(out, f(now + ttl))
  else
    if h ~= nil and (h.token + BASE ~= token or (h.owner ~= '' and h.owner ~= owner)) then
      record_stale(id, token, lowner, 'renew', now)
    end
    table.insert(out, '')
  end
end
return out
