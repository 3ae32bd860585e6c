-- requeue_list: dead letters of one list queue back onto that queue, each in one step
-- with its removal from the dead list. A dead list holds JSON letters (`msg`, `reason`,
-- `ts`, ...); the caller names each letter by its exact bytes, so a letter is found
-- whatever was pushed or removed around it meanwhile. Each is looked up here, inside the
-- script: one that a concurrent requeue or purge already removed is skipped, so a letter
-- requeued twice goes back once. (Two letters with the same bytes are two letters: each
-- requeue takes one.)
-- A job key that is scheduled again in the delay pool (its producer pushed it anew since
-- it died) is left alone: the newer message wins, and the letter stays for the operator.
--
-- KEYS[1] dead LIST, KEYS[2] the queue LIST, KEYS[3] the queue's deliveries HASH (the
-- message's fetch count starts again from zero), KEYS[4] pool ZSET, KEYS[5] data HASH
-- ARGV triples: letter (exact bytes), job key ('' when it has none), message to push
-- The message goes onto the head of the queue (LPUSH, as a producer pushes), before the
-- letter leaves the dead list (ack last).
-- Returns one code per triple: 1 requeued, 0 gone, -1 job key scheduled again.
local w = wrong_type(KEYS[1], 'list', KEYS[2], 'list', KEYS[3], 'hash', KEYS[4], 'zset',
  KEYS[5], 'hash')
if w then return wrongtype_reply(w) end
local out = {}
for i = 1, #ARGV, 3 do
  local letter, key, msg = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if not redis.call('LPOS', KEYS[1], letter) then
    out[#out + 1] = 0
  elseif key ~= '' and (redis.call('ZSCORE', KEYS[4], key) or redis.call('HEXISTS', KEYS[5], key) == 1) then
    out[#out + 1] = -1
  else
    redis.call('LPUSH', KEYS[2], msg)
    redis.call('HDEL', KEYS[3], redis.sha1hex(msg))
    redis.call('LREM', KEYS[1], 1, letter)
    out[#out + 1] = 1
  end
end
return out
