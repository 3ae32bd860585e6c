-- count_starts: one start counted for each job about to begin its transaction (see
-- keys.rs, `starts`), before it begins: a message that kills its consumer is one whose job
-- started `--max-deliveries` times without being settled. HGET and HSET, not HINCRBY:
-- the commands the worker's ACL rules already allow.
--
-- KEYS: the HASHes counted in (the pool's `starts`; list mode: queues' deliveries)
-- ARGV: (index into KEYS, 1-based; field) pairs
-- Returns how many were counted; a HASH of another type counts nothing (its jobs run
-- uncounted).
local n = 0
for i = 1, #ARGV, 2 do
  local key = KEYS[tonumber(ARGV[i])]
  local c = redis.pcall('HGET', key, ARGV[i + 1])
  if type(c) ~= 'table' then
    redis.pcall('HSET', key, ARGV[i + 1], (tonumber(c) or 0) + 1)
    n = n + 1
  end
end
return n
