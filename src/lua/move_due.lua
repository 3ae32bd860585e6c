-- move_due: move up to `limit` due jobs from a delay pool to the stream or a list queue,
-- atomically. Any number of movers may call this at once: a member is read, appended and
-- removed inside one script, so no two calls can move the same member.
--
-- KEYS[1] pool ZSET, KEYS[2] data HASH, KEYS[3] target (events STREAM or queue LIST)
-- ARGV[1] now in unix milliseconds
-- ARGV[2] now in unix seconds (decimal)
-- ARGV[3] limit
-- ARGV[4] orphan grace in milliseconds
-- ARGV[5] 'stream' (XADD msg, key, due) or 'list' (LPUSH msg with a "job_key" field added)
-- ARGV[6] '' for our pool; for a legacy pool, the event its members stand for: each member
--         is then a STRING key holding an order id, and the message is built here
--         ({"event": ARGV[6], "payload": {"order_id": <id>}}). Those STRING keys are not
--         declared in KEYS: legacy pools work on a single Redis, not on Cluster.
-- ARGV[7] now in unix seconds (integer), the `ts` of messages built for a legacy pool
--
-- Scores below 1e11 are unix seconds, the rest unix milliseconds (DESIGN §1). Seconds
-- scores sort before any millisecond score, so each kind is one score range.
--
-- Each entry carries `due` (unix ms) so the pool can measure lateness.
--
-- Returns {moved, skipped, next_due_ms or -1, orphan keys...}. `skipped` counts due
-- members whose data has not arrived yet and are still inside the grace period.
local now_ms = tonumber(ARGV[1])
local limit = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local mode = ARGV[5]
local legacy = ARGV[6]
local moved, skipped = 0, 0
local result = {0, 0, -1}

local function json_string(s)
  return '"' .. string.gsub(s, '[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == '\\' then return '\\\\' end
    return string.format('\\u%04x', string.byte(c))
  end) .. '"'
end

-- The job key travels inside the message on a list (a list entry is one string).
local function with_job_key(msg, key)
  if string.sub(msg, 1, 1) ~= '{' or string.find(msg, '"job_key"', 1, true) then
    return msg
  end
  local rest = string.sub(msg, 2)
  local sep = ','
  if string.match(rest, '^%s*}') then sep = '' end
  return '{"job_key":' .. json_string(key) .. sep .. rest
end

local function fetch(key)
  if legacy == '' then
    return redis.call('HGET', KEYS[2], key)
  end
  local id = redis.call('GET', key)
  if not id then return false end
  local value = id
  if not string.match(id, '^%-?%d+$') then value = json_string(id) end
  return '{"event":' .. json_string(legacy) .. ',"payload":{"order_id":' .. value ..
    '},"retry":0,"ts":' .. ARGV[7] .. '}'
end

local function forget(key)
  if legacy == '' then redis.call('HDEL', KEYS[2], key) else redis.call('DEL', key) end
end

local function handle(items, scale)
  for i = 1, #items, 2 do
    local key = items[i]
    local due = tonumber(items[i + 1]) * scale
    local msg = fetch(key)
    if msg then
      if mode == 'list' then
        redis.call('LPUSH', KEYS[3], with_job_key(msg, key))
      else
        redis.call('XADD', KEYS[3], '*', 'msg', msg, 'key', key, 'due', math.floor(due))
      end
      forget(key)
      redis.call('ZREM', KEYS[1], key)
      moved = moved + 1
    elseif now_ms - due > grace then
      redis.call('ZREM', KEYS[1], key)
      result[#result + 1] = key
    else
      skipped = skipped + 1
    end
  end
end

local secs = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'WITHSCORES', 'LIMIT', 0, limit)
handle(secs, 1000)
local left = limit - #secs / 2
if left > 0 then
  handle(redis.call('ZRANGEBYSCORE', KEYS[1], '1e11', ARGV[1], 'WITHSCORES', 'LIMIT', 0, left), 1)
end

-- The earliest member not yet due, so the caller can sleep exactly until then.
local next_due = -1
local s = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[2], '(1e11', 'WITHSCORES', 'LIMIT', 0, 1)
if #s > 0 then next_due = tonumber(s[2]) * 1000 end
local m = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if #m > 0 then
  local d = tonumber(m[2])
  if next_due < 0 or d < next_due then next_due = d end
end
-- Lua numbers become integers in the reply; keep absurd scores (1e300, inf) in range.
if next_due > 9e15 then next_due = 9e15 end

result[1] = moved
result[2] = skipped
result[3] = next_due
return result
