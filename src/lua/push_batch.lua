-- push_batch: push.lua for many jobs of one key set in one atomic step (loading a
-- backlog: one round trip per batch, on a Redis Cluster too, where every key here shares
-- the set's hash slot).
-- KEYS as push.lua: [1] pool ZSET, [2] data HASH, [3] the pool's jobs HASH (type-checked only)
-- ARGV: job key, message JSON, score (due time), repeated for each job.
-- Returns how many of the keys were already scheduled (rescheduled, not duplicated).
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
if w then return wrongtype_reply(w) end
local again = 0
for i = 1, #ARGV - 2, 3 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then again = again + 1 end
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[1], ARGV[i + 2], ARGV[i])
end
return again
