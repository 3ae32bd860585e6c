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
-- How many letters at the head of the dead list (the newest) are looked through for a
-- newer letter of a key. A dead list has no index of its keys: a letter further back than
-- this goes back as if none were newer, so that the oldest letters of a long dead list can
-- still be requeued, and one call's look stays short (one pass over them for all of its
-- letters, which are then all in hand).
local SCAN_AT_MOST = 10000
-- A letter is looked for from the tail, where a requeue by filter takes its letters (the
-- oldest first): a call's look costs what lies behind its letters, not the whole list.
local function place(letter)
  return redis.call('LPOS', KEYS[1], letter, 'RANK', -1)
end
local triples, far = {}, 0
for i = 1, #ARGV, 3 do
  local pos = place(ARGV[i])
  triples[#triples + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2], pos}
  if pos and pos > far then far = pos end
end
-- The newest letter of each job key among those before the farthest of this call's (a
-- dead list is pushed at its head), and the newest one of other bytes than that (a letter
-- pushed twice is one letter twice, not a newer one), by the `key` field every letter of
-- ours carries as cjson writes it: inside a letter's other fields, which are JSON
-- strings, every quote is escaped, so only that field matches. (A key with a quote in it
-- is read short and matches none: such a letter goes back as if no newer one were there.)
local newest, other = {}, {}
local last = math.min(far, SCAN_AT_MOST) - 1
for from = 0, last, 500 do
  local page = redis.call('LRANGE', KEYS[1], from, math.min(from + 499, last))
  for j, l in ipairs(page) do
    local k = string.match(l, '"key":(%b"")')
    if k then
      local n = newest[k]
      if not n then
        newest[k] = {from + j - 1, l}
      elseif not other[k] and n[2] ~= l then
        other[k] = from + j - 1
      end
    end
  end
end
local function newer_letter(key, pos, letter)
  local k = cjson.encode(key)
  local n = newest[k]
  if not n then return false end
  if n[2] ~= letter then return n[1] < pos end
  return other[k] ~= nil and other[k] < pos
end
local out = {}
for _, t in ipairs(triples) do
  local letter, key, msg, pos = t[1], t[2], t[3], t[4]
  -- Looked up again: an earlier triple of this call may have taken the last copy.
  if not pos or not place(letter) then
    out[#out + 1] = 0
  elseif key ~= '' and (redis.call('ZSCORE', KEYS[4], key) or redis.call('HEXISTS', KEYS[5], key) == 1
      or newer_letter(key, pos, letter)) then
    out[#out + 1] = -1
  else
    redis.call('LPUSH', KEYS[2], msg)
    redis.call('HDEL', KEYS[3], redis.sha1hex(msg))
    redis.call('LREM', KEYS[1], -1, letter)
    out[#out + 1] = 1
  end
end
return out
