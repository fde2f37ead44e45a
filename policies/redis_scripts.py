"""Lua scripts of the Redis quota backend: one script per operation, so each runs atomically in Redis.

The bucket arithmetic is policies.quota's; the refusal order is policies.quota.choose_refusal's.
All keys of one call share the tenant's hash tag, so the scripts also run on Redis Cluster.
Numbers cross the Lua boundary as strings (Redis truncates Lua numbers to integers on return).
Time: ARGV[1] is unix seconds, or '' to use the Redis server clock (one clock for every replica).
"""

from __future__ import annotations

_COMMON = """
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
-- bucket = {level, ts, cap}; a missing bucket is full
local function load_bucket(key, cap, now)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if level == nil or ts == nil then return {cap, now, cap} end
  local elapsed = now - ts
  if elapsed < 0 then elapsed = 0 end
  level = math.min(cap, level + elapsed * cap / 60.0)
  return {level, math.max(ts, now), cap}
end
local function save_bucket(key, b)
  redis.call('HSET', key, 'level', fmt(b[1]), 'ts', fmt(b[2]))
  -- once full again the hash is redundant (a missing bucket is full): let it expire then
  local full_in_ms = math.ceil((b[3] - b[1]) / (b[3] / 60.0) * 1000) + 1000
  redis.call('PEXPIRE', key, full_in_ms)
end
local function bucket_wait(b, amount)
  if b[1] >= amount then return 0 end
  return (amount - b[1]) / (b[3] / 60.0)
end
"""

# KEYS: 1 requests bucket, 2 tokens bucket, 3 leases zset, 4 day budget, 5 month budget, 6 lease record
# ARGV: 1 now, 2 rpm, 3 tpm, 4 max concurrent, 5 reservation, 6 day budget (-1 none), 7 month budget,
#       8 lease id, 9 lease ttl s, 10 s to day end, 11 s to month end, 12 concurrency retry-after s,
#       13 day key ttl s, 14 month key ttl s, 15 lease record ttl s
# Returns {granted 0|1, reason, retry_after, requests level, tokens level, now}
ADMIT = _COMMON + """
local now = clock(ARGV[1])
local rpm, tpm, max_conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local reservation = tonumber(ARGV[5])
local day_budget, month_budget = tonumber(ARGV[6]), tonumber(ARGV[7])
local rq = load_bucket(KEYS[1], rpm, now)
local tk = load_bucket(KEYS[2], tpm, now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(now))
local live = redis.call('ZCARD', KEYS[3])
local day_used = tonumber(redis.call('GET', KEYS[4]) or '0')
local month_used = tonumber(redis.call('GET', KEYS[5]) or '0')

local reason, retry = '', 0
local rq_wait, tk_wait = bucket_wait(rq, 1), bucket_wait(tk, reservation)
local conc_full = live >= max_conc
if month_budget >= 0 and month_used + reservation > month_budget then
  reason, retry = 'monthly_budget', tonumber(ARGV[11])
elseif day_budget >= 0 and day_used + reservation > day_budget then
  reason, retry = 'daily_budget', tonumber(ARGV[10])
elseif rq_wait > 0 or tk_wait > 0 then
  if rq_wait >= tk_wait then reason = 'requests' else reason = 'tokens' end
  retry = math.max(rq_wait, tk_wait)
  if conc_full then retry = math.max(retry, tonumber(ARGV[12])) end
elseif conc_full then
  reason, retry = 'concurrency', tonumber(ARGV[12])
end
if reason ~= '' then
  return {0, reason, fmt(retry), fmt(rq[1]), fmt(tk[1]), fmt(now)}
end

rq[1] = rq[1] - 1
tk[1] = tk[1] - reservation
save_bucket(KEYS[1], rq)
save_bucket(KEYS[2], tk)
redis.call('INCRBY', KEYS[4], reservation)
redis.call('EXPIRE', KEYS[4], ARGV[13])
redis.call('INCRBY', KEYS[5], reservation)
redis.call('EXPIRE', KEYS[5], ARGV[14])
local ttl = tonumber(ARGV[9])
redis.call('ZADD', KEYS[3], fmt(now + ttl), ARGV[8])
redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * 1000) + 60000)
redis.call('HSET', KEYS[6], 'reserved', reservation)
redis.call('EXPIRE', KEYS[6], ARGV[15])
return {1, '', '0', fmt(rq[1]), fmt(tk[1]), fmt(now)}
"""

# KEYS: 1 tokens bucket, 2 lease record, 3 day budget, 4 month budget
# ARGV: 1 now, 2 actual total tokens, 3 tpm at admission
# Returns 1 when settled now, 0 when already settled or unknown.
RECONCILE = _COMMON + """
local rec = redis.call('HMGET', KEYS[2], 'reserved', 'settled')
if not rec[1] or rec[2] then return 0 end
local now = clock(ARGV[1])
local refund = tonumber(rec[1]) - tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local tk = load_bucket(KEYS[1], tpm, now)
tk[1] = math.max(-tpm, math.min(tpm, tk[1] + refund))
save_bucket(KEYS[1], tk)
-- NOTE: no INCRBY by 0: Lua renders -0 as "-0", which Redis refuses as an integer (the script would stop
-- half way, after the bucket write and before 'settled').
if refund ~= 0 then
  for i = 3, 4 do
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], -refund) end
  end
end
redis.call('HSET', KEYS[2], 'settled', '1')
return 1
"""

# KEYS: 1 leases zset   ARGV: 1 now, 2 lease id, 3 ttl s
# Returns 1 when extended, 0 when the lease is gone or expired.
RENEW = _COMMON + """
local now = clock(ARGV[1])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not expiry then return 0 end
if tonumber(expiry) <= now then
  redis.call('ZREM', KEYS[1], ARGV[2])
  return 0
end
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], fmt(now + ttl), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 60000)
return 1
"""

# KEYS: 1 leases zset, 2 day budget, 3 month budget   ARGV: 1 now
# Returns {live leases, day tokens, month tokens}. Read-only.
USAGE = _COMMON + """
local now = clock(ARGV[1])
local live = redis.call('ZCOUNT', KEYS[1], '(' .. fmt(now), '+inf')
return {live, redis.call('GET', KEYS[2]) or '0', redis.call('GET', KEYS[3]) or '0'}
"""
