-- ADJUST (proxy.shared.rate_limits.ADJUST_SCRIPT): Redis runs bucket.lua followed by this
-- file (now_ms, load, store come from there; see proxy/shared/lua/__init__.py).
-- KEYS[1] {P}:replica:<id> (sequence of the last batch applied), KEYS[2] {P}:rsv:<id> (its
-- reserve log), KEYS[3..] bucket hashes
-- ARGV[1] batch sequence number, ARGV[2] keep (ms), ARGV[3] C: the buckets corrected are KEYS[3..2+C];
-- then per corrected bucket: requests/min, tokens/min, requests to charge, tokens to charge
-- (negative: give back); then per reserve written off (its reply never came: the replica served
-- the request from its local share and charges that take here): its number, its tokens, B, then
-- B x (index into KEYS of a bucket it took from, requests/min, tokens/min). A written-off reserve
-- that ran is given back; one that has not run yet never will (it finds its mark 'x<n>').
-- returns 1 if applied, 0 if this batch was applied before (a resend)
local seq = tonumber(ARGV[1])
local last = tonumber(redis.call('HGET', KEYS[1], 'rl_seq') or '-1')
if seq <= last then return 0 end
local now = now_ms()
local keep = tonumber(ARGV[2])
local c = tonumber(ARGV[3])
for j = 1, c do
  local b = 4 + 4 * (j - 1)
  local rpm, tpm, dr, dt = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local r, tk = load(KEYS[2 + j], rpm, tpm, now)
  if rpm > 0 then r = math.min(rpm, r - dr) end
  if tpm > 0 then tk = math.min(tpm, tk - dt) end
  store(KEYS[2 + j], r or 0, tk or 0, rpm, tpm, now)
end
local a = 4 + 4 * c
local wrote = false
while a <= #ARGV do
  local id = tostring(tonumber(ARGV[a]))
  local n, nb = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local took = redis.call('ZSCORE', KEYS[2], id)
  a = a + 3
  for _ = 1, nb do
    if took then
      local key, rpm, tpm = KEYS[tonumber(ARGV[a])], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
      local r, tk = load(key, rpm, tpm, now)
      if rpm > 0 then r = math.min(rpm, r + 1) end
      if tpm > 0 then tk = math.min(tpm, tk + n) end
      store(key, r or 0, tk or 0, rpm, tpm, now)
    end
    a = a + 3
  end
  if took then redis.call('ZREM', KEYS[2], id) end
  redis.call('ZADD', KEYS[2], tonumber(id), 'x' .. id)
  wrote = true
end
if wrote then redis.call('PEXPIRE', KEYS[2], keep) end
redis.call('HSET', KEYS[1], 'rl_seq', seq)
redis.call('PEXPIRE', KEYS[1], keep)
return 1
