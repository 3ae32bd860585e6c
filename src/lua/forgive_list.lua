-- forgive_list: list mode's `forgive` (see forgive.lua): at a graceful stop, this
-- consumer's fetch of each message still in its processing lists is taken off the
-- message's delivery count. The messages stay where they are, for the next start or a
-- peer (after the stop's drain each was fetched and never run: found from outside,
-- restarts under a cap made good jobs dead letters for too many fetches, never run).
--
-- KEYS: per queue: this consumer's processing list, the queue's deliveries HASH
-- Returns how many messages it looked at.
local n = 0
for i = 1, #KEYS, 2 do
  -- A key of another type is left as it is (the reader reports it); the others go on.
  local msgs = redis.pcall('LRANGE', KEYS[i], 0, -1)
  if type(msgs) == 'table' and not msgs.err then
    for _, msg in ipairs(msgs) do
      n = n + 1
      forgive_fetch(KEYS[i + 1], msg)
    end
  end
end
return n
