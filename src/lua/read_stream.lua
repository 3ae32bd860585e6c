-- read_stream: XREADGROUP for this consumer inside Redis, so that no entry over the size
-- limit ever reaches the worker (see `screen` in the prelude). Never blocks: the reader
-- waits between empty reads itself.
--
-- KEYS[1] events STREAM, KEYS[2] dead STREAM, KEYS[3] and KEYS[4] the pool's `moved` and
-- `letters` indexes, KEYS[5] its `starts` HASH (see the prelude)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] count, ARGV[4] id ('>' for new entries, or a
-- cursor into this consumer's own pending entries), ARGV[5] max bytes
-- Returns {gone, {entries}, {key, reason, ...} of the buried, {key, found, wanted} or {}}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3],
  'STREAMS', KEYS[1], ARGV[4])
local entries = {}
if r and r[1] then entries = r[1][2] end
local kept, gone, buried, blocked = screen(entries, ARGV[1], ARGV[2], tonumber(ARGV[5]), server_s())
return {gone, kept, buried, blocked}
