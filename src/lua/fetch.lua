-- fetch: reliable fetch from list queues in priority order (DESIGN §4).
-- Each message moves atomically from the tail of its queue to the head of this consumer's
-- processing list of that queue, so a crash leaves it there, never nowhere. The first
-- queue is drained first, as with BRPOP's key order.
--
-- Each fetch counts the message (by digest) in the queue's deliveries HASH; settling it
-- clears the count. A message fetched more than ARGV[2] times without being settled (it
-- kills its consumer, which restarts and pushes it back) goes to the dead list instead.
--
-- KEYS: per queue: queue, processing list, deliveries HASH, dead list
-- ARGV[1] the most messages to take, ARGV[2] max deliveries, ARGV[3] now (unix seconds),
-- ARGV[4] consumer name, then the queue names in order
-- Returns {queue index (0-based), message, ...}.
local max = tonumber(ARGV[1])
local max_deliveries = tonumber(ARGV[2])
local out = {}
local n = 0
for i = 1, #KEYS, 4 do
  while n < max do
    local msg = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'RIGHT', 'LEFT')
    if not msg then break end
    local digest = redis.sha1hex(msg)
    local count = redis.call('HINCRBY', KEYS[i + 2], digest, 1)
    if count > max_deliveries then
      redis.call('LREM', KEYS[i + 1], 1, msg)
      redis.call('HDEL', KEYS[i + 2], digest)
      redis.call('LPUSH', KEYS[i + 3], cjson.encode({
        msg = msg, ts = tonumber(ARGV[3]), consumer = ARGV[4], queue = ARGV[4 + (i + 3) / 4],
        reason = 'fetched ' .. (count - 1) .. ' times without being settled (limit ' .. max_deliveries .. ')',
        event = '', key = '', attempts = count - 1
      }))
    else
      n = n + 1
      out[#out + 1] = (i - 1) / 4
      out[#out + 1] = msg
    end
  end
  if n >= max then break end
end
return out
