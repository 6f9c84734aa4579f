-- RESERVE (proxy.shared.rate_limits.RESERVE_SCRIPT): Redis runs bucket.lua followed by this
-- file (now_ms, load, store come from there; see proxy/shared/lua/__init__.py).
-- KEYS[1] {P}:rsv:<replica id>: this replica's reserve log; KEYS[2..] bucket hashes
-- ARGV[1] tokens to take, ARGV[2] this reserve's number, ARGV[3] the replica's floor (every
-- number below it is settled there), ARGV[4] keep (ms); then per bucket: requests/min,
-- tokens/min (0 = none)
-- returns JSON {ok = 1|0, wait = seconds, i = index of the refusing bucket, u = 'requests'|'tokens',
--               lv = [[r, t], ...] levels after the take (or now, when refused),
--               gone = 1: the replica wrote this reserve off before it ran (nothing taken)}
local now = now_ms()
local log, seq, floor, keep = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local id = tostring(seq)
local seen = redis.call('ZMSCORE', log, 'floor', 'x' .. id, id)
local fl = tonumber(seen[1] or 0)
if seq < fl or seen[2] then
  return cjson.encode({ok = 0, gone = 1, wait = 0, i = 0, u = '', lv = {}})
end
if seen[3] then  -- taken before (a resent pipeline): once only
  return cjson.encode({ok = 1, wait = 0, i = 0, u = '', lv = {}})
end
-- what the replica has settled needs no record any more; forgotten in steps of 32 (a mark
-- below the replica's floor is safe: a settled reserve never runs again, or is marked x<n>)
if floor >= fl + 32 then
  redis.call('ZREMRANGEBYSCORE', log, '-inf', '(' .. floor)
  redis.call('ZADD', log, floor, 'floor')
end
local n = tonumber(ARGV[1])
local lv, wait, wi, wu = {}, 0, 0, ''
for j = 1, #KEYS - 1 do
  local key, rpm, tpm = KEYS[j + 1], tonumber(ARGV[3 + 2 * j]), tonumber(ARGV[4 + 2 * j])
  local r, tk = load(key, rpm, tpm, now)
  lv[j] = {r or -1, tk or -1}
  if rpm > 0 and r < math.min(1, rpm) then
    local w = (math.min(1, rpm) - r) * 60 / rpm
    if w > wait then wait, wi, wu = w, j, 'requests' end
  end
  if tpm > 0 and tk < math.min(n, tpm) then
    local w = (math.min(n, tpm) - tk) * 60 / tpm
    if w > wait then wait, wi, wu = w, j, 'tokens' end
  end
end
if wait > 0 then
  return cjson.encode({ok = 0, wait = wait, i = wi, u = wu, lv = lv})
end
for j = 1, #KEYS - 1 do
  local key, rpm, tpm = KEYS[j + 1], tonumber(ARGV[3 + 2 * j]), tonumber(ARGV[4 + 2 * j])
  local r, tk = load(key, rpm, tpm, now)
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then tk = tk - n end
  store(key, r or 0, tk or 0, rpm, tpm, now)
  lv[j] = {r or -1, tk or -1}
end
redis.call('ZADD', log, seq, id)  -- taken: kept until the replica has heard of it
redis.call('PEXPIRE', log, keep)
return cjson.encode({ok = 1, wait = 0, i = 0, u = '', lv = lv})
