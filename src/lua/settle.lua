-- settle: apply the outcomes of a batch of stream entries, atomically.
-- Each entry is acknowledged; a retry is written back to the delay pool and a dead
-- letter appended in the same step, and only if this call is the one that acknowledged
-- the entry (XACK returned 1). An entry that a peer already settled is left alone, so a
-- reclaimed entry is never retried or dead-lettered twice.
--
-- KEYS[1] events STREAM, KEYS[2] pool ZSET, KEYS[3] data HASH, KEYS[4] dead STREAM
-- ARGV[1] group, ARGV[2] now (unix seconds), ARGV[3] consumer name
-- then records of 7 fields: kind, entry id, job key, message, score-or-reason, event,
-- attempts. kind: 'A' ack, 'R' retry (score = due time), 'D' dead letter (reason).
-- Returns the number of entries this call acknowledged.
local acked = 0
for i = 4, #ARGV, 7 do
  local kind, id = ARGV[i], ARGV[i + 1]
  local n = redis.call('XACK', KEYS[1], ARGV[1], id)
  acked = acked + n
  if n == 1 then
    if kind == 'R' then
      redis.call('HSET', KEYS[3], ARGV[i + 2], ARGV[i + 3])
      redis.call('ZADD', KEYS[2], ARGV[i + 4], ARGV[i + 2])
    elseif kind == 'D' then
      redis.call('XADD', KEYS[4], '*',
        'msg', ARGV[i + 3], 'reason', ARGV[i + 4], 'ts', ARGV[2],
        'event', ARGV[i + 5], 'key', ARGV[i + 2], 'attempts', ARGV[i + 6],
        'consumer', ARGV[3], 'id', id)
    end
  end
end
return acked
