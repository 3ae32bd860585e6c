-- requeue_list: dead letters of one list queue back onto that queue, each in one step
-- with its removal from the dead list. A dead list holds JSON letters (`msg`, `reason`,
-- `ts`, ...); the caller names each letter by its exact bytes, so a letter is found
-- whatever was pushed or removed around it meanwhile. Each is looked up here, inside the
-- script: one that a concurrent requeue or purge already removed is skipped, so a letter
-- requeued twice goes back once. (Two letters with the same bytes are two letters: each
-- requeue takes one.)
-- A job key that is scheduled again in the delay pool (its producer pushed it anew since
-- it died) is left alone: the newer message wins, and the letter stays for the operator.
-- So is a letter when a newer letter of its key is still in the dead list (a retry a
-- newer push replaced, then that push's own job): the newer one goes back, in this call
-- or another, and the older one would only run the replaced job after it (found from
-- outside in stream mode; the stream's requeue keeps the same rule).
--
-- KEYS[1] dead LIST, KEYS[2] the queue LIST, KEYS[3] the queue's deliveries HASH (the
-- message's fetch count starts again from zero), KEYS[4] pool ZSET, KEYS[5] data HASH
-- ARGV triples: letter (exact bytes), job key ('' when it has none), message to push
-- The message goes onto the head of the queue (LPUSH, as a producer pushes), before the
-- letter leaves the dead list (ack last).
-- Returns one code per triple: 1 requeued, 0 gone, -1 job key scheduled again (or a newer
-- letter of it dead).
local w = wrong_type(KEYS[1], 'list', KEYS[2], 'list', KEYS[3], 'hash', KEYS[4], 'zset',
  KEYS[5], 'hash')
if w then return wrongtype_reply(w) end
-- How many letters newer than a letter are looked through for one of its key. A dead list
-- has no index of its keys: past this many the letter goes back as if none were there,
-- so that the oldest letters of a long dead list can still be requeued.
local SCAN_AT_MOST = 100000
-- A newer letter of `key` than the one at `pos` is in the dead list: one of the letters
-- before it (a dead list is pushed at its head) with the `key` field every letter of ours
-- carries, as cjson writes it (inside a letter's other fields, which are JSON strings,
-- every quote is escaped, so only that field can match).
local function newer_letter(key, pos)
  local needle = '"key":' .. cjson.encode(key)
  local last = math.min(pos, SCAN_AT_MOST) - 1
  for from = 0, last, 500 do
    for _, l in ipairs(redis.call('LRANGE', KEYS[1], from, math.min(from + 499, last))) do
      if string.find(l, needle, 1, true) then return true end
    end
  end
  return false
end
local out = {}
for i = 1, #ARGV, 3 do
  local letter, key, msg = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local pos = redis.call('LPOS', KEYS[1], letter)
  if not pos then
    out[#out + 1] = 0
  elseif key ~= '' and (redis.call('ZSCORE', KEYS[4], key) or redis.call('HEXISTS', KEYS[5], key) == 1
      or newer_letter(key, pos)) then
    out[#out + 1] = -1
  else
    redis.call('LPUSH', KEYS[2], msg)
    redis.call('HDEL', KEYS[3], redis.sha1hex(msg))
    redis.call('LREM', KEYS[1], 1, letter)
    out[#out + 1] = 1
  end
end
return out
