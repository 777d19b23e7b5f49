-- held.lua: whether a job lease is still held (running, same owner and token,
-- unexpired), read only: a caller's early check before a ledger write.
--
-- KEYS[1]  the store's prefix; reads job:<id>, epoch, epoch_replid
-- ARGV[1]  now ('' = Redis TIME);  ARGV[2] the epoch the store holds ('' = none)
-- ARGV[3]  job id;  ARGV[4] token;  ARGV[5] owner
-- Returns  1 (held) or 0.
local now = now_of(ARGV[1])
check_epoch(ARGV[2])
local h = job_head(ARGV[3])
if h ~= nil and h.state == 'running' and h.token + BASE == tonumber(ARGV[4])
   and h.owner == ARGV[5] and h.expires ~= nil and h.expires > now then
  return 1
end
return 0
