-- cancel: remove a scheduled job, score and data together.
-- KEYS[1] pool ZSET, KEYS[2] data HASH, KEYS[3] the pool's jobs HASH; ARGV[1] job key
-- Returns 1 if the job existed. The score goes first: the mover never sees a member
-- whose data vanished under it.
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
if w then return wrongtype_reply(w) end
local a = redis.call('ZREM', KEYS[1], ARGV[1])
local b = redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1], copy_field(ARGV[1]))
if a + b > 0 then return 1 else return 0 end
