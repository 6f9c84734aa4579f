-- LEASE (proxy.shared.leases.LEASE_SCRIPT): renew this replica, store its capacity report,
-- plan every live replica's target and grant this one its share (the rules: the docstring of
-- proxy/shared/leases.py).
-- KEYS[1] {P}:replicas   KEYS[2] {P}:epoch   KEYS[3..] {P}:lease:<capacity key>
-- ARGV[1] replica id
-- ARGV[2] lease (ms)
-- ARGV[3] keep (ms): idle lifetime of the keys written here
-- ARGV[4] JSON list aligned with KEYS[3..]: [C, applied, inflight, [[inflight, waiting, weight, min_share], ...], open]
--         per capacity key, highest class first (open 0: this replica cannot dispatch there
--         now, plan it nothing); 0 removes this replica from that key
-- ARGV[5] 'sync' | 'rejoin' (back from a local fallback share: open a rebuild window) | 'leave'
-- returns JSON {g = [grant per key], c = [capacity per key], n = live replicas, rank = 0-based
--               position of this replica among the live ids, rebuild = 0|1}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local lease_ms = tonumber(ARGV[2])
local keep_ms = tonumber(ARGV[3])
local reports = cjson.decode(ARGV[4])
local mode = ARGV[5]

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if mode == 'leave' then
  redis.call('ZREM', KEYS[1], rid)
  for i = 3, #KEYS do redis.call('HDEL', KEYS[i], rid) end
  return cjson.encode({g = {}, c = {}, n = redis.call('ZCARD', KEYS[1]), rank = 0, rebuild = 0})
end
redis.call('ZADD', KEYS[1], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[1], keep_ms)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(ids)
local live, rank = {}, 0
for i, id in ipairs(ids) do
  live[id] = true
  if id == rid then rank = i - 1 end
end
local n = #ids

-- the rebuild window: opened when the epoch is missing (Redis lost its keys, or a cold start)
-- or when a replica comes back from its fallback share; for one lease no grant grows
local rebuild_until = tonumber(redis.call('HGET', KEYS[2], 'rebuild_until'))
if rebuild_until == nil or mode == 'rejoin' then
  rebuild_until = now + lease_ms
  redis.call('HSET', KEYS[2], 'rebuild_until', rebuild_until)
end
redis.call('PEXPIRE', KEYS[2], keep_ms)
local rebuilding = now < rebuild_until

-- weighted max-min fair division of `budget` among `parts` ({want, w}); returns floats
local function waterfill(budget, parts)
  local order, W = {}, 0
  for _, p in ipairs(parts) do
    p.a = 0
    if p.want > 0 then table.insert(order, p); W = W + p.w end
  end
  table.sort(order, function(x, y)
    local rx, ry = x.want / x.w, y.want / y.w
    if rx == ry then return x.id < y.id end
    return rx < ry
  end)
  for _, p in ipairs(order) do
    if W <= 0 or budget <= 0 then break end
    p.a = math.min(p.want, budget * p.w / W)
    budget = budget - p.a
    W = W - p.w
  end
end

-- integer units: floors, then the units left over go to the largest remainders
local function integerize(parts, total)
  local given = 0
  for _, p in ipairs(parts) do
    local f = math.floor(p.a + 1e-9)
    p.frac = p.a - f
    p.a = f
    given = given + f
  end
  local extra = math.floor(total + 1e-9) - given
  if extra <= 0 then return given end
  local order = {}
  for _, p in ipairs(parts) do if p.a < p.want and p.frac > 1e-9 then table.insert(order, p) end end
  table.sort(order, function(x, y)
    if x.frac == y.frac then return x.id < y.id end
    return x.frac > y.frac
  end)
  for i = 1, math.min(extra, #order) do order[i].a = order[i].a + 1; given = given + 1 end
  return given
end

-- the parts of level `lvl` that want units now: {id, want, w}, weighted ones and weight-0 ones
local function parts_at(open, want, lvl)
  local pos, zero = {}, {}
  for _, e in ipairs(open) do
    local d = e.d[lvl]
    local wt = want[e.id][lvl]
    if d and wt > 0 then
      local w = tonumber(d[3]) or 0
      if w > 0 then table.insert(pos, {id = e.id, want = wt, w = w})
      else table.insert(zero, {id = e.id, want = wt, w = 1}) end
    end
  end
  return pos, zero
end

-- targets for all entries (sorted by id) out of capacity C. Only open entries (o ~= 0: the
-- replica can dispatch to the resource) are planned; a closed one's target is 0 (its claim
-- still counts what it has in flight there).
local function plan(entries, C)
  local target, want, open = {}, {}, {}
  local levels = 0
  for _, e in ipairs(entries) do
    target[e.id] = 0
    if e.o ~= 0 then
      table.insert(open, e)
      want[e.id] = {}
      for lvl, d in ipairs(e.d) do
        want[e.id][lvl] = (tonumber(d[1]) or 0) + (tonumber(d[2]) or 0)
      end
      if #e.d > levels then levels = #e.d end
    end
  end
  local budget = C
  -- give up to `cap` units to level `lvl`'s wants: weighted first, weight 0 from what they leave
  local function give(lvl, cap)
    for _, parts in ipairs({parts_at(open, want, lvl)}) do
      local room = math.min(cap, budget)
      if #parts > 0 and room > 0 then
        waterfill(room, parts)
        local sum = 0
        for _, p in ipairs(parts) do sum = sum + p.a end
        local given = integerize(parts, sum)
        budget, cap = budget - given, cap - given
        for _, p in ipairs(parts) do
          target[p.id] = target[p.id] + p.a
          want[p.id][lvl] = want[p.id][lvl] - p.a
        end
      end
    end
  end
  -- floors first: a class with min_share m (the smallest any open entry reports) gets up to
  -- ceil(m * C) units before strict priority, for the replicas where it has demand
  for lvl = 1, levels do
    local m = nil
    for _, e in ipairs(open) do
      local d = e.d[lvl]
      if d then
        local v = tonumber(d[4]) or 0
        if m == nil or v < m then m = v end
      end
    end
    if m and m > 0 and budget > 0 then give(lvl, math.ceil(m * C - 1e-9)) end
  end
  -- then strict priority, highest class first
  for lvl = 1, levels do
    if budget <= 0 then break end
    give(lvl, budget)
  end
  if budget > 0 and #open > 0 then
    local each = math.floor(budget / #open)
    local rest = budget - each * #open
    for i, e in ipairs(open) do
      target[e.id] = target[e.id] + each + ((i <= rest) and 1 or 0)
    end
  end
  return target
end

local grants, caps = {}, {}
for i, rep in ipairs(reports) do
  local key = KEYS[i + 2]
  if rep == 0 then
    redis.call('HDEL', key, rid)
    grants[i], caps[i] = 0, 0
  else
    local cap, applied, inflight, demand = tonumber(rep[1]), tonumber(rep[2]), tonumber(rep[3]), rep[4]
    local open = (rep[5] == 0) and 0 or 1
    local raw = redis.call('HGETALL', key)
    local entries, others, C = {}, 0, cap
    for j = 1, #raw, 2 do
      local id = raw[j]
      if id ~= rid then
        if live[id] then
          local e = cjson.decode(raw[j + 1])
          e.id = id
          if e.o == nil then e.o = 1 end
          table.insert(entries, e)
          others = others + math.max(e.a, e.g, e.f)
          if e.c < C then C = e.c end
        else
          redis.call('HDEL', key, id)
        end
      end
    end
    table.insert(entries, {id = rid, a = applied, g = 0, f = inflight, c = cap, d = demand, o = open})
    table.sort(entries, function(x, y) return x.id < y.id end)
    local g = math.min(plan(entries, C)[rid], C - others)
    if rebuilding then g = math.min(g, applied) end
    if g < 0 then g = 0 end
    redis.call('HSET', key, rid, cjson.encode({a = applied, g = g, f = inflight, c = cap, d = demand, o = open}))
    redis.call('PEXPIRE', key, keep_ms)
    grants[i], caps[i] = g, C
  end
end
return cjson.encode({g = grants, c = caps, n = n, rank = rank, rebuild = rebuilding and 1 or 0})
