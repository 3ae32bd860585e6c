-- count_since: how many entries of a stream have an id at or after ARGV[1], up to ARGV[2].
-- Read only. Counting server side spares the caller downloading every entry (dead
-- letters carry whole messages); pages keep each XRANGE reply small, the cap bounds the
-- time a flood can hold the server.
--
-- KEYS[1] STREAM; ARGV[1] first id (a bare millisecond time is `<ms>-0`); ARGV[2] cap
-- Returns the count.
local cap = tonumber(ARGV[2])
local start = ARGV[1]
local n = 0
while n < cap do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', math.min(1000, cap - n))
  if #page == 0 then break end
  n = n + #page
  start = '(' .. page[#page][1]
end
return n
