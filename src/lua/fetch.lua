-- fetch: reliable fetch from list queues in priority order. Each message moves atomically
-- from the tail of its queue to the head of this consumer's processing list of that
-- queue, so a crash leaves it there, never nowhere. The first queue is drained first, as
-- with BRPOP's key order. Never blocks: the reader waits between empty fetches itself.
--
-- A message over the size limit never reaches the worker: its dead letter (a prefix, its
-- length and a digest) is pushed onto the queue's dead list, then it leaves the queue.
-- Each fetch counts the message (by digest) in the queue's deliveries HASH; settling it
-- clears the count. A message that would be fetched more than ARGV[2] times without being
-- settled, and whose job started that often (`started:<digest>` in the same HASH, counted
-- by the workers before each transaction of a message fetched before, the first fetch's
-- start not counted: it kills its consumer, which restarts and pushes it back), is not
-- fetched: the fetch stops there and names it, for the caller to look its job up in the inbox and
-- then settle it with `bury_fetched` (a job whose transaction committed is done, never
-- also a dead letter; the others go to the dead list). Stopping keeps the queues' order.
-- One fetched that often whose job started less often was held unrun by consumers
-- stopped meanwhile (fetched ahead of their workers): no fault of its own, it is fetched,
-- its count set back to its starts and this fetch.
-- A queue whose queue, processing list or deliveries key holds another type is skipped
-- and reported; the rest go on.
--
-- KEYS: per queue: queue, processing list, deliveries HASH, dead list
-- ARGV[1] the most messages to take, ARGV[2] max deliveries, ARGV[3] consumer name,
-- ARGV[4] max bytes, then the queue names in order
-- Returns {n, {queue index (0-based), message, times fetched, ...}, {key, reason, ...} of
-- the buried,
-- {key, found, wanted} if a queue was skipped or {}, {queue index, message, times fetched}
-- of a message fetched too often or {}}.
local max = tonumber(ARGV[1])
local max_deliveries = tonumber(ARGV[2])
local max_bytes = tonumber(ARGV[4])
local now_s = server_s()
local out, buried = {}, {}
local blocked = nil
local n = 0
local function bury(dead, queue, msg, reason, attempts, length, digest)
  list_letter(dead, queue, msg, reason, attempts, length, digest, ARGV[3], max_bytes, now_s)
  buried[#buried + 1] = queue
  buried[#buried + 1] = reason
end
local overfetched = nil
for i = 1, #KEYS, 4 do
  local queue_name = ARGV[4 + (i + 3) / 4]
  local w = wrong_type(KEYS[i], 'list', KEYS[i + 1], 'list', KEYS[i + 2], 'hash')
  -- The dead list is needed only for a message that must be buried; while it holds
  -- another type such a message stays in its queue (moved to its head) until the key is
  -- fixed, and the rest of the queue goes on.
  local dead_bad = wrong_type(KEYS[i + 3], 'list')
  if w then
    blocked = blocked or w
  else
    local rotations = redis.call('LLEN', KEYS[i])
    while n < max do
      local msg = redis.call('LINDEX', KEYS[i], -1)
      if not msg then break end
      local digest = redis.sha1hex(msg)
      local over = #msg > max_bytes
      local count = tonumber(redis.call('HGET', KEYS[i + 2], digest) or '0') + 1
      if count > max_deliveries and not over then
        local started = tonumber(redis.call('HGET', KEYS[i + 2], 'started:' .. digest) or '0')
        if started < max_deliveries then count = started + 1 end
      end
      if (over or count > max_deliveries) and dead_bad then
        -- It cannot be buried: it goes to the head of its queue (still queued, never
        -- lost) so the messages behind it go on; each is looked at once per fetch.
        blocked = blocked or dead_bad
        rotations = rotations - 1
        if rotations < 0 then break end
        redis.call('LMOVE', KEYS[i], KEYS[i], 'RIGHT', 'LEFT')
      elseif over then
        bury(KEYS[i + 3], queue_name, string.sub(msg, 1, OVERSIZE_PREFIX),
          oversize_reason(#msg, max_bytes), 0, #msg, digest)
        redis.call('RPOP', KEYS[i])
      elseif count > max_deliveries then
        overfetched = {(i - 1) / 4, msg, count - 1}
        break
      else
        redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'RIGHT', 'LEFT')
        redis.call('HSET', KEYS[i + 2], digest, count)
        n = n + 1
        out[#out + 1] = (i - 1) / 4
        out[#out + 1] = msg
        out[#out + 1] = count
      end
    end
  end
  if n >= max or overfetched then break end
end
return {n, out, buried, blocked or {}, overfetched or {}}
