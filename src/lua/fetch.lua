-- fetch: reliable fetch from list queues in priority order (DESIGN §4).
-- Each message moves atomically from the tail of its queue to the head of this consumer's
-- processing list of that queue, so a crash leaves it there, never nowhere. The first
-- queue is drained first, as with BRPOP's key order.
--
-- KEYS: queue 1, processing 1, queue 2, processing 2, ...
-- ARGV[1] the most messages to take
-- Returns {queue index (0-based), message, ...}.
local max = tonumber(ARGV[1])
local out = {}
local n = 0
for i = 1, #KEYS, 2 do
  while n < max do
    local msg = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'RIGHT', 'LEFT')
    if not msg then break end
    n = n + 1
    out[#out + 1] = (i - 1) / 2
    out[#out + 1] = msg
  end
  if n >= max then break end
end
return out
