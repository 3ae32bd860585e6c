-- keep_claimed: start the idle time of entries this consumer still owns again (XCLAIM to
-- itself, JUSTID: nothing read, no delivery counted), so that no reader takes them back as
-- a stuck consumer's while a worker holds them for their --max-rate slots. An entry that
-- another consumer owns now (a peer took this one's entries over while it was stopped) is
-- left to it, and one no longer pending (settled meanwhile) is left alone.
--
-- KEYS[1] events STREAM
-- ARGV[1] group, ARGV[2] consumer, then the ids
-- Returns the ids claimed again.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local args = {KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p > 0 then args[#args + 1] = ARGV[i] end
end
if #args == 4 then return {} end
args[#args + 1] = 'JUSTID'
return redis.call('XCLAIM', unpack(args))
