-- purge: delete dead letters by id, and each from the pool's `letters` index (its job key
-- read from the letter itself).
--
-- KEYS[1] dead STREAM, KEYS[2] the pool's `letters` index (see the prelude)
-- ARGV the ids
-- Returns how many letters were still there.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local removed = 0
for _, id in ipairs(ARGV) do
  local r = redis.call('XRANGE', KEYS[1], id, id)
  if #r > 0 then
    local _, key = entry_fields(r[1][2])
    unindex_letter(KEYS[2], key, id)
    removed = removed + redis.call('XDEL', KEYS[1], id)
  end
end
return {removed}
