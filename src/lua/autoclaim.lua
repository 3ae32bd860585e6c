-- autoclaim: XAUTOCLAIM entries idle longer than the claim timeout on any consumer, with
-- the size screen of the prelude.
--
-- KEYS[1] events STREAM, KEYS[2] dead STREAM, KEYS[3] and KEYS[4] the pool's `moved` and
-- `letters` indexes, KEYS[5] its `starts` HASH (see the prelude)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] min idle (ms), ARGV[4] cursor, ARGV[5] count,
-- ARGV[6] max bytes
-- Returns {gone, {entries}, {key, reason, ...} of the buried, {key, found, wanted} or {},
-- next cursor}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4],
  'COUNT', ARGV[5])
local kept, gone, buried, blocked = screen(r[2], ARGV[1], ARGV[2], tonumber(ARGV[6]), server_s())
local deleted = 0
if r[3] then
  deleted = #r[3]
  forget_starts(r[3])
end
return {gone + deleted, kept, buried, blocked, r[1]}
