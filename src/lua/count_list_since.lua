-- count_list_since: how many letters of a dead LIST have a `ts` (unix seconds, when the
-- message died) at or after ARGV[1], and how many of those are letters of lost data (a
-- reason starting with "lost data", see move_due.lua). Read only. Letters are pushed onto the head, so it
-- walks from the head in pages and stops at the first letter older than ARGV[1] minus
-- ARGV[3] seconds (writers on different hosts differ a little in their clocks, so a letter
-- slightly out of order does not end the count early), or after ARGV[2] letters looked
-- at: the cap bounds the time a flood can hold the server. `ts` is read with a pattern,
-- not a JSON decode: the writers (cjson) put it at the top level as an integer, and the
-- same characters inside the escaped `msg` or `reason` strings always carry a backslash.
--
-- KEYS[1] dead LIST; ARGV[1] since (unix seconds), ARGV[2] cap, ARGV[3] slack (seconds)
-- Returns {count, lost}.
local since, cap, slack = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n, seen, lost = 0, 0, 0
while seen < cap do
  local page = redis.call('LRANGE', KEYS[1], seen, seen + math.min(100, cap - seen) - 1)
  if #page == 0 then break end
  for _, letter in ipairs(page) do
    local ts = tonumber(string.match(letter, '"ts":(%-?%d+)'))
    if ts then
      if ts >= since then
        n = n + 1
        if string.find(letter, '"reason":"lost data', 1, true) then lost = lost + 1 end
      elseif ts < since - slack then
        return {n, lost}
      end
    end
  end
  seen = seen + #page
end
return {n, lost}
