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
-- ARGV[1] burst (microseconds), then per cap: its name, its interval (microseconds), n
-- Returns the microseconds until the last slot taken is due (0: the jobs run now).
local w = wrong_type(KEYS[1], 'hash')
if w then return wrongtype_reply(w) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local burst = tonumber(ARGV[1])
local till = now
for i = 2, #ARGV, 3 do
  local free = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '')
  local interval = tonumber(ARGV[i + 1])
  local b = math.max(burst, interval)
  local start = now - b
  if free and free + b > now then start = free end
  local last = start + interval * tonumber(ARGV[i + 2])
  if last > till then till = last end
end
for i = 2, #ARGV, 3 do
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.0f', till))
end
return till - now
