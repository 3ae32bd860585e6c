-- hasten: bring forward the retries of jobs that waited for a lock whose holder's
-- transaction has ended, so that each runs now rather than at the end of its backoff (up
-- to 30 s later). Only a retry that is still the one this worker wrote is touched: its
-- score and its data as written, not yet due. A push of its key since (new data, a new
-- score), a peer's retry of it or its move to the stream leave it as it is.
--
-- KEYS[1] pool ZSET, KEYS[2] data HASH
-- ARGV: triples of job key, the retry's score (unix ms), the SHA-1 of its message (hex)
-- Returns the job keys brought forward.
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash')
if w then return wrongtype_reply(w) end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #ARGV, 3 do
  local key, score = ARGV[i], tonumber(ARGV[i + 1])
  local at = tonumber(redis.call('ZSCORE', KEYS[1], key))
  if at and at == score and at > now_ms and redis.sha1hex(redis.call('HGET', KEYS[2], key) or '') == ARGV[i + 2] then
    redis.call('ZADD', KEYS[1], 'XX', now_ms, key)
    out[#out + 1] = key
  end
end
return out
