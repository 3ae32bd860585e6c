-- push: schedule (or reschedule) one job, data before score, in one atomic step.
-- KEYS[1] pool ZSET, KEYS[2] data HASH, KEYS[3] the pool's jobs HASH (type-checked only:
-- a retry record left there no longer matches the data, so the mover knows this push is a
-- new job and reports the retry it replaced)
-- ARGV[1] job key, ARGV[2] message JSON, ARGV[3] score (due time)
-- Returns 1 if the key was already scheduled (a reschedule), else 0.
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
if w then return wrongtype_reply(w) end
local existed = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
if existed then return 1 else return 0 end
