-- count_starts: the starts of jobs counted (see keys.rs, `starts`): ARGV[1] '1' as each
-- job's transaction begins, '-1' once it has ended (a start the process saw the end of
-- is no sign of a message that kills its consumer; a field that reaches 0 is removed),
-- '0' to read them. A message that kills its consumer is one whose job started
-- `--max-deliveries` times without being settled. HGET, HSET and HDEL, not HINCRBY: the
-- commands the worker's ACL rules already allow.
--
-- KEYS: the HASHes counted in (the pool's `starts`; list mode: queues' deliveries)
-- ARGV[1] the change, then (index into KEYS, 1-based; field) pairs
-- Returns each job's count after the change, in order; -1 for one whose HASH holds
-- another type (its job runs uncounted).
local delta = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 2 do
  local key, field = KEYS[tonumber(ARGV[i])], ARGV[i + 1]
  local c = redis.pcall('HGET', key, field)
  if type(c) == 'table' then
    out[#out + 1] = -1
  else
    local n = math.max((tonumber(c) or 0) + delta, 0)
    if delta ~= 0 and n > 0 then
      redis.call('HSET', key, field, n)
    elseif delta ~= 0 and c then
      redis.call('HDEL', key, field)
    end
    out[#out + 1] = n
  end
end
return out
