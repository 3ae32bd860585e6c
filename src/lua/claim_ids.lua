-- claim_ids: deliver to this consumer entries it already owns (taken over from a dead
-- peer), by id, with the size screen of the prelude. XCLAIM with content counts a
-- delivery, as a read does. An id whose entry is gone is dropped from the pending list.
--
-- KEYS[1] events STREAM, KEYS[2] dead STREAM, KEYS[3] and KEYS[4] the pool's `moved` and
-- `letters` indexes, KEYS[5] its `starts` HASH (see the prelude)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] max bytes, then the ids
-- Returns {gone, {entries}, {key, reason, ...} of the buried, {key, found, wanted} or {}}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
-- Only those it still owns: one a peer took from it meanwhile (this process had no usable
-- PostgreSQL, and marked itself so) stays the peer's, and is left out here.
local ids = {}
for i = 4, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    ids[#ids + 1] = ARGV[i]
  end
end
if #ids == 0 then return {0, {}, {}, {}} end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids))
if #claimed < #ids then
  local found, lost = {}, {}
  for _, e in ipairs(claimed) do found[e[1]] = true end
  for _, id in ipairs(ids) do
    if not found[id] then lost[#lost + 1] = id end
  end
  forget_starts(lost)
end
local kept, gone, buried, blocked = screen(claimed, ARGV[1], ARGV[2], tonumber(ARGV[3]), server_s())
return {gone + #ids - #claimed, kept, buried, blocked}
