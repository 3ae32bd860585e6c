-- count_since: how many entries of a stream have an id at or after ARGV[1], up to ARGV[2],
-- and how many of those are letters of lost data (a `reason` starting with "lost data":
-- a pool member whose data vanished, see move_due.lua). Read only. Counting server side
-- spares the caller downloading every entry (dead letters carry whole messages); pages
-- keep each XRANGE reply small, the cap bounds the time a flood can hold the server.
--
-- KEYS[1] STREAM; ARGV[1] first id (a bare millisecond time is `<ms>-0`); ARGV[2] cap
-- Returns {count, lost}.
local cap = tonumber(ARGV[2])
local start = ARGV[1]
local n, lost = 0, 0
while n < cap do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', math.min(1000, cap - n))
  if #page == 0 then break end
  n = n + #page
  for _, e in ipairs(page) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'reason' then
        if string.sub(f[i + 1], 1, 9) == 'lost data' then lost = lost + 1 end
        break
      end
    end
  end
  start = '(' .. page[#page][1]
end
return {n, lost}
