-- The token bucket in Redis: the Lua twin of qos.TokenBucket (qos/rate_limit.py), the one
-- rule in Python. Capacity = the per-minute limit (one minute of burst), refilled at
-- limit / 60000 per ms up to the capacity; a take may drive the level into debt; a missing
-- key is a full bucket. Not a script on its own: proxy.shared.lua prepends it to reserve.lua
-- and adjust.lua, which call now_ms, load and store. tests/test_shared_lua.py holds
-- this file and qos.TokenBucket to the same answers.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
-- levels of one bucket pair (requests r, tokens t) refilled to now; a missing key is full
local function load(key, rpm, tpm, now)
  local v = redis.call('HMGET', key, 'r', 't', 'ts')
  local r, tk, ts = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]) or now
  local dt = math.max(0, now - ts)
  if rpm > 0 then r = r and math.min(rpm, r + dt * rpm / 60000) or rpm end
  if tpm > 0 then tk = tk and math.min(tpm, tk + dt * tpm / 60000) or tpm end
  return r, tk
end
-- write back; the key lives until both buckets would be full again (then missing = full)
local function store(key, r, tk, rpm, tpm, now)
  local full_ms = 0
  redis.call('DEL', key)
  local fields = {'ts', tostring(now)}
  if rpm > 0 and r < rpm then
    full_ms = math.max(full_ms, (rpm - r) * 60000 / rpm)
    table.insert(fields, 'r'); table.insert(fields, tostring(r))
  end
  if tpm > 0 and tk < tpm then
    full_ms = math.max(full_ms, (tpm - tk) * 60000 / tpm)
    table.insert(fields, 't'); table.insert(fields, tostring(tk))
  end
  if full_ms > 0 then
    redis.call('HSET', key, unpack(fields))
    redis.call('PEXPIRE', key, math.ceil(full_ms) + 1000)
  end
end
