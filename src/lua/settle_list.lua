-- settle_list: apply the outcomes of a batch of list messages, atomically. Each message is
-- removed from the processing list it sits in; a retry is written back to the delay pool
-- and a dead letter pushed onto the queue's dead list in the same step, and only if this
-- call removed the message (LREM returned 1), so nothing is settled twice.
--
-- KEYS[1] pool ZSET, KEYS[2] data HASH, then per queue: processing LIST, dead LIST,
-- deliveries HASH (the message's fetch count is cleared once it is settled)
-- ARGV[1] now (unix seconds), ARGV[2] consumer name, then records of 8 fields:
--   kind ('A' ack, 'R' retry, 'D' dead), queue index (0-based), queue name, job key,
--   message as delivered, retry message or reason, due score or event, attempts
-- Returns the number of messages removed.
local removed = 0
for i = 3, #ARGV, 8 do
  local kind, q = ARGV[i], tonumber(ARGV[i + 1])
  local processing, dead, deliveries = KEYS[3 + q * 3], KEYS[4 + q * 3], KEYS[5 + q * 3]
  local n = redis.call('LREM', processing, 1, ARGV[i + 4])
  removed = removed + n
  if n == 1 then
    redis.call('HDEL', deliveries, redis.sha1hex(ARGV[i + 4]))
    if kind == 'R' then
      redis.call('HSET', KEYS[2], ARGV[i + 3], ARGV[i + 5])
      redis.call('ZADD', KEYS[1], ARGV[i + 6], ARGV[i + 3])
    elseif kind == 'D' then
      redis.call('LPUSH', dead, cjson.encode({
        msg = ARGV[i + 4], reason = ARGV[i + 5], ts = tonumber(ARGV[1]),
        event = ARGV[i + 6], key = ARGV[i + 3], attempts = tonumber(ARGV[i + 7]),
        consumer = ARGV[2], queue = ARGV[i + 2]
      }))
    end
  end
end
return removed
