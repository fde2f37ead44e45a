"""Lua scripts that make each multi-key write of the Redis store atomic (Redis runs a script alone).

Each constant documents its KEYS and ARGV. Scripts return `false` (None in Python) or 0 when the
tenant or record they need does not exist, so the caller can raise NotFoundError.
"""

from __future__ import annotations

# KEYS: tenant_by_name, tenant:{id}.  ARGV: name, id, field, value, ...
CREATE_TENANT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
return 1
"""

# KEYS: tenant:{id}.  ARGV: field, value, ...  Returns {before, after} as flat field lists.
UPDATE_TENANT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local before = redis.call('HGETALL', KEYS[1])
if #ARGV > 0 then redis.call('HSET', KEYS[1], unpack(ARGV)) end
return {before, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: tenant:{tid}, key:{id}, key_by_hash, keys:{tid}, keys.  ARGV: hash, id, field, value, ...
CREATE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[2])
return 1
"""

# KEYS: key:{id}.  ARGV: now.  Keeps the first revocation time.
REVOKE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], 'revoked_at', ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: key_by_hash.  ARGV: hash, key prefix, tenant prefix.  Returns {key fields, tenant fields}.
FIND_KEY = """
local id = redis.call('HGET', KEYS[1], ARGV[1])
if not id then return false end
local tenant_id = redis.call('HGET', ARGV[2] .. id, 'tenant_id')
if not tenant_id then return false end
return {redis.call('HGETALL', ARGV[2] .. id), redis.call('HGETALL', ARGV[3] .. tenant_id)}
"""

# KEYS: tenant:{tid}, adapter_versions:{tid}, adapters:{tid}, sha_refs, adapter_totals:{tid}, adapters_shared.
# ARGV: name, record key base, sha256, size_bytes, shared ('1'/'0'), max live versions, max live bytes
# ('-1': no limit), field, value, ...  Returns the new version, or {-1 | -2, count, bytes} (nothing written)
# when the tenant's live count (-1) or bytes (-2) would pass the limit: check and insert are one write.
ADD_ADAPTER_VERSION = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local totals = redis.call('HMGET', KEYS[5], 'count', 'bytes')
local count, bytes = tonumber(totals[1] or '0'), tonumber(totals[2] or '0')
if ARGV[6] ~= '-1' and count + 1 > tonumber(ARGV[6]) then return {-1, count, bytes} end
if ARGV[7] ~= '-1' and bytes + tonumber(ARGV[4]) > tonumber(ARGV[7]) then return {-2, count, bytes} end
local version = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local key = ARGV[2] .. version
redis.call('HSET', key, 'version', version, unpack(ARGV, 8))
redis.call('SADD', KEYS[3], key)
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
redis.call('HINCRBY', KEYS[5], 'count', 1)
redis.call('HINCRBY', KEYS[5], 'bytes', ARGV[4])
if ARGV[5] == '1' then redis.call('SADD', KEYS[6], key) end
return version
"""

# KEYS: adapter_versions:{tid}, sha_refs, adapter_totals:{tid}, adapters_shared.
# ARGV: name, record key base, now.  Returns the number of versions deleted.
DELETE_ADAPTER = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local deleted = 0
for version = 1, last do
  local key = ARGV[2] .. version
  if redis.call('EXISTS', key) == 1 and redis.call('HEXISTS', key, 'deleted_at') == 0 then
    local fields = redis.call('HMGET', key, 'sha256', 'size_bytes')
    redis.call('HSET', key, 'deleted_at', ARGV[3])
    if redis.call('HINCRBY', KEYS[2], fields[1], -1) <= 0 then redis.call('HDEL', KEYS[2], fields[1]) end
    redis.call('HINCRBY', KEYS[3], 'count', -1)
    redis.call('HINCRBY', KEYS[3], 'bytes', '-' .. fields[2])
    redis.call('SREM', KEYS[4], key)
    deleted = deleted + 1
  end
end
return deleted
"""

# KEYS: adapter_versions:{tid}, adapters_shared.  ARGV: name, record key base, shared ('1'/'0').
SET_ADAPTER_SHARED = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local changed = 0
for version = 1, last do
  local key = ARGV[2] .. version
  if redis.call('EXISTS', key) == 1 and redis.call('HEXISTS', key, 'deleted_at') == 0
      and redis.call('HGET', key, 'shared') ~= ARGV[3] then
    redis.call('HSET', key, 'shared', ARGV[3])
    if ARGV[3] == '1' then redis.call('SADD', KEYS[2], key) else redis.call('SREM', KEYS[2], key) end
    changed = changed + 1
  end
end
return changed
"""

# KEYS: tenant:{tid}, usage hours zset, hour hash, day hash.
# ARGV: hour_start, requests, prompt_tokens, completion_tokens, cached_tokens.
INCREMENT_USAGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
local fields = {'requests', 'prompt_tokens', 'completion_tokens', 'cached_tokens'}
for k = 3, 4 do
  for i = 1, 4 do redis.call('HINCRBY', KEYS[k], fields[i], ARGV[i + 1]) end
end
return 1
"""

# KEYS: audit:next, audit:ids, audit:entries.  ARGV: entry JSON.  Returns the new id.
APPEND_AUDIT = """
local id = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], id, id)
redis.call('HSET', KEYS[3], id, ARGV[1])
return id
"""
