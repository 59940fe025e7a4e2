"""The Lua scripts behind the commit state.

Each change that touches a checkpoint record together with the pointer, the deadlines or the
outbox runs as one script, so two coordinator replicas handling reports of the same step
at once cannot both commit it, lose a rank's report, or leave the pointer on a checkpoint
that has just become suspect. Python decides (verification, policies); Lua applies the
decision only if the record is still in the state the decision was made on.

Numbers are passed and stored as strings formatted by Python: Lua would print floats with
14 significant digits.
"""

from __future__ import annotations

from typing import Final

HELPERS: Final = r"""
local function onset_hit(id, o, step, t0)
  if type(o.step) == 'number' then
    if step >= o.step then
      return 'saved at or after the open ' .. o.kind .. ' onset at step '
        .. string.format('%d', o.step) .. ' (anomaly ' .. id .. ')'
    end
  elseif type(o.at) == 'number' and t0 >= o.at then
    return 'saved after the open ' .. o.kind .. ' onset (anomaly ' .. id .. ')'
  end
  return nil
end

-- since: when the oldest state in the save started over (a load or a fresh process). At or
-- past a rollback's step, only state that started over after the rollback is trusted: ranks
-- still on the bad state save on until their reload or restart reaches them.
local function suspect_reason(base, step, t0, since)
  local rb = redis.call('GET', base .. ':rollback')
  if rb then
    local r = cjson.decode(rb)
    if step >= r.below and since < r.at then
      return 'saved from state older than the rollback below step '
        .. string.format('%d', r.below)
    end
  end
  local on = redis.call('HGETALL', base .. ':onsets')
  for i = 1, #on, 2 do
    local why = onset_hit(on[i], cjson.decode(on[i + 1]), step, t0)
    if why then return why end
  end
  return ''
end

-- The pointer is the newest committed record that is not suspect.
local function repoint(base)
  local steps = redis.call('ZREVRANGE', base .. ':steps', 0, -1)
  local chosen = ''
  for _, s in ipairs(steps) do
    local v = redis.call('HMGET', base .. ':rec:' .. s, 'status', 'suspect', 'point')
    if v[1] == 'committed' and (not v[2] or v[2] == '') and v[3] and v[3] ~= '' then
      chosen = v[3]
      break
    end
  end
  local old = redis.call('GET', base .. ':pointer') or ''
  if chosen ~= old then
    if chosen == '' then
      redis.call('DEL', base .. ':pointer')
    else
      redis.call('SET', base .. ':pointer', chosen)
    end
  end
  return {old, chosen}
end
"""

REPORT: Final = HELPERS + r"""
-- ARGV: base step rank report_id report_json world_size attempt path now deadline_at
--       new_id ok sender_time member deadlines_key job save_started generation state_since
-- generation: the worker group of the save (or 'a<attempt>' from older clients): a report
-- of another group starts the step's round over; ranks of one group may carry different
-- attempts (each node's torchrun counts its own restarts).
local base, step, rank = ARGV[1], ARGV[2], ARGV[3]
local key = base .. ':rec:' .. step
local status = redis.call('HGET', key, 'status')
local reset, dup = false, false
if status then
  local prev = redis.call('HGET', key, 'i:' .. rank)
  if status == 'deleting' then
    return {'busy', '0', '0', '0', '', ''}
  elseif prev == ARGV[4] then
    if status ~= 'pending' then
      return {'closed', redis.call('HGET', key, 'round'), '0', '0', '', ''}
    end
    dup = true
  elseif redis.call('HGET', key, 'gen') ~= ARGV[18] then
    reset = true
  elseif status == 'pending' then
    reset = false  -- the same rank saved again in this attempt: its newer report replaces
  elseif status == 'failed' and not prev then
    -- A rank missing from a failed round: its report is late, unless its save started after
    -- the round closed (then it is a new save of the same step).
    if tonumber(ARGV[17]) <= tonumber(redis.call('HGET', key, 'closed_at') or '0') then
      return {'late', redis.call('HGET', key, 'round'), '0', '0', '', ''}
    end
    reset = true
  else
    reset = true  -- a new save of a step that was closed
  end
end
local round = 1
if reset then
  round = tonumber(redis.call('HGET', key, 'round') or '0') + 1
  redis.call('DEL', key)
end
if reset or not status then
  redis.call('HSET', key, 'status', 'pending', 'job', ARGV[16], 'step', step, 'path', ARGV[8],
    'world_size', ARGV[6], 'attempt', ARGV[7], 'round', tostring(round), 'id', ARGV[11],
    'first_at', ARGV[9], 'deadline', ARGV[10], 'n', '0', 't0', ARGV[13], 'suspect', '',
    'retained', '1', 'bad', '', 'gen', ARGV[18], 'since', ARGV[19])
  redis.call('ZADD', base .. ':steps', step, step)
  redis.call('ZADD', ARGV[15], ARGV[10], ARGV[14])
end
if not dup then
  if not redis.call('HGET', key, 'i:' .. rank) then
    redis.call('HINCRBY', key, 'n', 1)
  end
  redis.call('HSET', key, 'i:' .. rank, ARGV[4], 'r:' .. rank, ARGV[5])
  if ARGV[12] ~= '1' then redis.call('HSET', key, 'bad', '1') end
  if tonumber(ARGV[6]) > tonumber(redis.call('HGET', key, 'world_size')) then
    redis.call('HSET', key, 'world_size', ARGV[6])
  end
  if tonumber(ARGV[13]) < tonumber(redis.call('HGET', key, 't0')) then
    redis.call('HSET', key, 't0', ARGV[13])
  end
  if tonumber(ARGV[19]) < tonumber(redis.call('HGET', key, 'since') or ARGV[19]) then
    redis.call('HSET', key, 'since', ARGV[19])
  end
end
local ptr = {'', ''}
if reset then ptr = repoint(base) end
local v = redis.call('HMGET', key, 'round', 'n', 'world_size', 'bad')
local state = 'pending'
if v[4] == '1' then
  state = 'failing'
elseif tonumber(v[2]) >= tonumber(v[3]) then
  state = 'complete'
end
return {state, v[1], v[2], v[3], ptr[1], ptr[2]}
"""

CLOSE: Final = HELPERS + r"""
-- ARGV: base step round status closed_at fields_json member deadlines_key outbox_key
local key = ARGV[1] .. ':rec:' .. ARGV[2]
local v = redis.call('HMGET', key, 'status', 'round', 't0', 'since')
if v[1] ~= 'pending' or v[2] ~= ARGV[3] then
  return {0, '', '', ''}
end
for k, val in pairs(cjson.decode(ARGV[6])) do
  redis.call('HSET', key, k, val)
end
redis.call('HSET', key, 'status', ARGV[4], 'closed_at', ARGV[5])
redis.call('ZREM', ARGV[8], ARGV[7])
redis.call('SADD', ARGV[9], ARGV[7])
local suspect = ''
if ARGV[4] == 'committed' then
  suspect = suspect_reason(ARGV[1], tonumber(ARGV[2]), tonumber(v[3]),
                           tonumber(v[4] or v[3]))
  redis.call('HSET', key, 'suspect', suspect)
end
local ptr = repoint(ARGV[1])
return {1, suspect, ptr[1], ptr[2]}
"""

ONSET: Final = HELPERS + r"""
-- ARGV: base anomaly_id onset_json outbox_key job
local base, id = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', base .. ':handled', id) == 1 then
  return {'handled', '', ''}
end
redis.call('HSET', base .. ':onsets', id, ARGV[3])
local o = cjson.decode(ARGV[3])
local out = {'open', '', ''}
for _, s in ipairs(redis.call('ZRANGE', base .. ':steps', 0, -1)) do
  local key = base .. ':rec:' .. s
  local v = redis.call('HMGET', key, 'status', 'suspect', 't0')
  if v[1] == 'committed' and (not v[2] or v[2] == '') then
    local why = onset_hit(id, o, tonumber(s), tonumber(v[3]))
    if why then
      redis.call('HSET', key, 'suspect', why)
      redis.call('SADD', ARGV[4], ARGV[5] .. '/' .. s)
      table.insert(out, s)
    end
  end
end
local ptr = repoint(base)
out[2], out[3] = ptr[1], ptr[2]
return out
"""

ROLLBACK: Final = HELPERS + r"""
-- ARGV: base below rollback_json reason outbox_key job
local base = ARGV[1]
local out = {'', ''}
for _, s in ipairs(redis.call('ZRANGEBYSCORE', base .. ':steps', ARGV[2], '+inf')) do
  local key = base .. ':rec:' .. s
  local v = redis.call('HMGET', key, 'status', 'suspect')
  if v[1] == 'committed' and (not v[2] or v[2] == '') then
    redis.call('HSET', key, 'suspect', ARGV[4])
    redis.call('SADD', ARGV[5], ARGV[6] .. '/' .. s)
    table.insert(out, s)
  end
end
for _, id in ipairs(redis.call('HKEYS', base .. ':onsets')) do
  redis.call('SADD', base .. ':handled', id)
end
redis.call('DEL', base .. ':onsets')
redis.call('SET', base .. ':rollback', ARGV[3])
local ptr = repoint(base)
if ptr[2] ~= '' then
  redis.call('SET', base .. ':pin', string.format('%d', cjson.decode(ptr[2]).step))
end
out[1], out[2] = ptr[1], ptr[2]
return out
"""

EXPIRE: Final = r"""
-- ARGV: base delete step...
local base = ARGV[1]
local ptr = redis.call('GET', base .. ':pointer')
local pstep = -1
if ptr then pstep = cjson.decode(ptr).step end
local pin = tonumber(redis.call('GET', base .. ':pin') or '-1')
local out = {}
for i = 3, #ARGV do
  local s = tonumber(ARGV[i])
  local key = base .. ':rec:' .. ARGV[i]
  local v = redis.call('HMGET', key, 'status', 'retained')
  if v[1] == 'committed' and s ~= pstep and s ~= pin and (ARGV[2] == '1' or v[2] == '1') then
    if ARGV[2] == '1' then
      redis.call('HSET', key, 'status', 'deleting', 'retained', '0')
    else
      redis.call('HSET', key, 'retained', '0')
    end
    table.insert(out, ARGV[i])
  end
end
return out
"""

DELETED: Final = r"""
-- ARGV: base step
local key = ARGV[1] .. ':rec:' .. ARGV[2]
if redis.call('HGET', key, 'status') == 'deleting' then
  redis.call('HSET', key, 'status', 'deleted')
  return 1
end
return 0
"""

PRUNE: Final = r"""
-- ARGV: base limit: drop the oldest closed records beyond limit (never pointer or pin).
local base, limit = ARGV[1], tonumber(ARGV[2])
local excess = redis.call('ZCARD', base .. ':steps') - limit
if excess <= 0 then return 0 end
local ptr = redis.call('GET', base .. ':pointer')
local pstep = -1
if ptr then pstep = cjson.decode(ptr).step end
local pin = tonumber(redis.call('GET', base .. ':pin') or '-1')
local dropped = 0
for _, s in ipairs(redis.call('ZRANGE', base .. ':steps', 0, -1)) do
  if dropped >= excess then break end
  local n = tonumber(s)
  local key = base .. ':rec:' .. s
  local v = redis.call('HMGET', key, 'status', 'retained')
  local closed = v[1] == 'failed' or v[1] == 'deleted'
    or (v[1] == 'committed' and v[2] == '0') or not v[1]
  if closed and n ~= pstep and n ~= pin then
    redis.call('DEL', key)
    redis.call('ZREM', base .. ':steps', s)
    dropped = dropped + 1
  end
end
return dropped
"""
