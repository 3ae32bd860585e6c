-- forgive: at a graceful stop, take this consumer's delivery of each entry it still has
-- pending off the entry's delivery count. After the stop's drain every such entry is one
-- the process read and never ran (held for its `--max-rate` slots, or waiting in the
-- channel; or one whose commit it could not confirm), so that delivery says nothing of the
-- entry itself (found from outside: restarts under a cap made good jobs dead letters for
-- too many deliveries, never run). A process that died (kill -9, a panic) forgives
-- nothing: an entry that kills its consumer looks just like that.
--
-- KEYS[1] events STREAM
-- ARGV[1] group, ARGV[2] this consumer, ARGV[3] most entries per call, ARGV[4] where to
-- start ('-', or '(' and the last id of the call before)
-- Returns {how many entries it looked at (fewer than ARGV[3]: all of them), the last id}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], '+', ARGV[3], ARGV[2])
claim_counted(KEYS[1], ARGV[1], ARGV[2], 0, p, true)
if #p == 0 then return {0, ''} end
return {#p, p[#p][1]}
