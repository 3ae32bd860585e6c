-- settle: apply the outcomes of a batch of stream entries. Ack last: a retry is written
-- back to the delay pool, or a dead letter appended, before the entry is acknowledged,
-- and only while the entry is still pending (a peer that settled it first wins, so a
-- reclaimed entry is never retried or dead-lettered twice). A record whose destination
-- key holds another type is left pending, untouched, and reported; the others go on.
--
-- KEYS[1] events STREAM, KEYS[2] pool ZSET, KEYS[3] data HASH, KEYS[4] dead STREAM,
-- KEYS[5] the pool's jobs HASH (a retry keeps its job id through the pool), KEYS[6] and
-- KEYS[7] the pool's `moved` and `letters` indexes (see the prelude), KEYS[8] the pool's
-- `starts` HASH (the starts of a settled entry's job are counted no more)
-- ARGV[1] group, ARGV[2] consumer name
-- then records of 7 fields: kind, entry id, job key, message, score-or-reason, event,
-- attempts (an ack's job key is given for the index; its other fields are empty). kind: 'A' ack, 'R' retry (score = due time), 'D' dead letter (reason).
-- Returns one code per record (1 settled by this call, 2 settled as a dead letter because
-- its retry was superseded by a newer push of its key, 0 already settled, -1 left
-- pending: a key of another type), then {key, found, wanted} if any was -1.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local pool_bad = wrong_type(KEYS[2], 'zset', KEYS[3], 'hash', KEYS[5], 'hash')
local dead_bad = wrong_type(KEYS[4], 'stream')
local blocked = nil
local out = {}
-- Whether the key was pushed again and moved since this entry was (the `moved` index
-- names a newer entry): its retry written back would run after the newer job and turn
-- that job's own retry into a "superseded" letter (found from outside: the older job ran,
-- the newer push became the dead letter).
local function moved_again(key, id)
  local m = redis.pcall('HGET', KEYS[6], key)
  return type(m) == 'string' and m ~= id
end
local function pending(id)
  return #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0
end
local now_s = server_s()
-- {job key, entry id, ...} of the entries this call settled, for the `moved` index.
local settled = {}
for i = 3, #ARGV, 7 do
  local kind, id = ARGV[i], ARGV[i + 1]
  local code
  local superseded = false
  if kind == 'A' then
    code = redis.call('XACK', KEYS[1], ARGV[1], id)
  elseif kind == 'R' and pool_bad then
    code, blocked = -1, pool_bad
  elseif kind == 'D' and dead_bad then
    code, blocked = -1, dead_bad
  elseif kind == 'R' and dead_bad and (pushed_again(KEYS[2], KEYS[3], ARGV[i + 2]) or
      moved_again(ARGV[i + 2], id)) then
    code, blocked = -1, dead_bad
  elseif not pending(id) then
    code = 0
  else
    if kind == 'R' and (pushed_again(KEYS[2], KEYS[3], ARGV[i + 2]) or
        moved_again(ARGV[i + 2], id)) then
      -- The key was pushed again while this job ran, and a push reschedules its key: the
      -- newer push keeps the slot, this retry becomes a dead letter (nothing vanishes).
      local event, attempts = retry_facts(ARGV[i + 3])
      local letter = redis.call('XADD', KEYS[4], '*',
        'msg', ARGV[i + 3], 'reason', SUPERSEDED, 'ts', now_s,
        'event', event, 'key', ARGV[i + 2], 'attempts', attempts,
        'consumer', ARGV[2], 'id', id)
      index_letter(KEYS[7], ARGV[i + 2], letter)
      superseded = true
    elseif kind == 'R' then
      remember_job(KEYS[5], ARGV[i + 2], ARGV[i + 3])
      redis.call('HSET', KEYS[3], ARGV[i + 2], ARGV[i + 3])
      redis.call('ZADD', KEYS[2], ARGV[i + 4], ARGV[i + 2])
    else
      local letter = redis.call('XADD', KEYS[4], '*',
        'msg', ARGV[i + 3], 'reason', ARGV[i + 4], 'ts', now_s,
        'event', ARGV[i + 5], 'key', ARGV[i + 2], 'attempts', ARGV[i + 6],
        'consumer', ARGV[2], 'id', id)
      index_letter(KEYS[7], ARGV[i + 2], letter)
    end
    code = redis.call('XACK', KEYS[1], ARGV[1], id)
    if superseded and code == 1 then code = 2 end
  end
  if code == 1 or code == 2 then
    settled[#settled + 1] = ARGV[i + 2]
    settled[#settled + 1] = id
  end
  out[#out + 1] = code
end
unindex_moves(KEYS[6], settled)
-- Only jobs delivered before have starts counted: in a drain the HASH is mostly absent.
if redis.call('EXISTS', KEYS[8]) == 1 then
  local ids = {}
  for j = 2, #settled, 2 do ids[#ids + 1] = settled[j] end
  in_chunks(ids, INDEX_CHUNK, function(...) redis.pcall('HDEL', KEYS[8], ...) end)
end
if blocked then
  out[#out + 1] = blocked[1]; out[#out + 1] = blocked[2]; out[#out + 1] = blocked[3]
end
return out
