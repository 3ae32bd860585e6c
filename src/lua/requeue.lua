-- requeue: dead letters back into the delay pool, each in one step with its XDEL.
-- Each letter is re-read by id here, inside the script: one that a concurrent requeue
-- or purge already removed is skipped, so a letter requeued twice goes back once. (The
-- caller computed the message from the same id; stream entries never change, so the
-- id pins the content.)
-- A job key that is scheduled again (its producer pushed it anew since it died) is left
-- alone: the newer message wins, and the letter stays for the operator to purge.
--
-- KEYS[1] dead STREAM, KEYS[2] pool ZSET, KEYS[3] data HASH, KEYS[4] the pool's jobs HASH
-- (a requeued letter stays the same job: its stamp is remembered, as for a retry),
-- KEYS[5] the pool's `letters` index (see the prelude)
-- ARGV[1] due score (unix ms), then triples: dead-letter id, job key, message
-- Data and score are written before the XDEL (ack last).
-- Returns one code per triple: 1 requeued, 0 gone, -1 job key scheduled again.
local w = wrong_type(KEYS[1], 'stream', KEYS[2], 'zset', KEYS[3], 'hash', KEYS[4], 'hash')
if w then return wrongtype_reply(w) end
local out = {}
for i = 2, #ARGV, 3 do
  local id, key, msg = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
    out[#out + 1] = 0
  elseif redis.call('ZSCORE', KEYS[2], key) or redis.call('HEXISTS', KEYS[3], key) == 1 then
    out[#out + 1] = -1
  else
    -- Data before score, as push.lua: the mover never sees a member without data.
    remember_job(KEYS[4], key, msg)
    redis.call('HSET', KEYS[3], key, msg)
    redis.call('ZADD', KEYS[2], ARGV[1], key)
    redis.call('XDEL', KEYS[1], id)
    unindex_letter(KEYS[5], key, id)
    out[#out + 1] = 1
  end
end
return out
