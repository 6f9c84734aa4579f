-- SERVICE (proxy.shared.counters.SERVICE_SCRIPT): push this replica's service increments
-- once per batch, read the global counters back.
-- KEYS[1] {P}:replica:<id>, KEYS[2..] {P}:svc:<pool>:<user>
-- ARGV[1] batch sequence number (0: no increments in this call), ARGV[2] counter ttl (ms),
-- ARGV[3] keep (ms), ARGV[3 + i] the increment for KEYS[1 + i] (0: read only)
-- returns the counters' values after the increments (strings, '0' when missing)
local seq = tonumber(ARGV[1])
local apply = false
if seq > 0 then
  apply = seq > tonumber(redis.call('HGET', KEYS[1], 'svc_seq') or '-1')
  if apply then
    redis.call('HSET', KEYS[1], 'svc_seq', seq)
    redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  end
end
local ttl = tonumber(ARGV[2])
local out = {}
for i = 2, #KEYS do
  local inc = tonumber(ARGV[2 + i])
  local v
  if apply and inc ~= 0 then
    v = redis.call('INCRBYFLOAT', KEYS[i], inc)
  else
    v = redis.call('GET', KEYS[i])
  end
  if v then
    redis.call('PEXPIRE', KEYS[i], ttl)
  else
    v = '0'
  end
  out[i - 1] = v
end
return out
