-- take_slots: the --max-rate schedules of every process of this prefix, so that a cap is
-- the fleet's, not each process's. Each cap is a schedule of slots `interval` apart (GCRA):
-- the time its next slot is free, on Redis's clock, in one field of a hash. A share of jobs
-- takes `n` slots of each cap that applies to it; after a quiet spell `burst` of slots are
-- free at once, and at least one (the first job under 1/m runs at once, not a minute on). Every cap taken goes on from the latest of the slots taken (the jobs run
-- then), so a cap that would let them run earlier does not count them at slots they do
-- not use and let the next jobs in early.
--
-- KEYS[1] the rates HASH (schedule -> next free slot in unix microseconds; a schedule is
-- `<cap>@<interval in microseconds>`, the cap `*` for every job, else an event's name)
-- ARGV[1] burst, ARGV[2] horizon (microseconds), then per cap: its schedule, its interval
-- (microseconds), n
--
-- Slots are booked at most `horizon` ahead: a share whose last slot is further off books
-- nothing and is told when to ask again, so that a process stopped while its workers wait
-- leaves at most that much of the cap unused (8 workers booking ahead under 6/m each held
-- a slot 10 s after the last: the next start waited 100 s). A schedule further ahead than
-- that can be booked (a clock stepped back, a value written by hand) starts again.
-- Returns {1, microseconds until the last slot taken is due (0: now)} when booked, else
-- {0, microseconds until it may be asked again}.
local w = wrong_type(KEYS[1], 'hash')
if w then return wrongtype_reply(w) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local burst = tonumber(ARGV[1])
local horizon = tonumber(ARGV[2])
local till = now
local span = 0
for i = 3, #ARGV, 3 do
  local free = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '')
  local interval = tonumber(ARGV[i + 1])
  local n = tonumber(ARGV[i + 2])
  local b = math.max(burst, interval)
  if free and free > now + horizon + b then free = nil end
  local start = now - b
  if free and free + b > now then start = free end
  local last = start + interval * n
  if last > till then till = last end
  if interval * (n - 1) > span then span = interval * (n - 1) end
end
-- A share of several slots is booked once the first of them is near.
if till - now > horizon + span then
  return {0, till - now - horizon - span}
end
for i = 3, #ARGV, 3 do
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.0f', till))
end
return {1, till - now}
