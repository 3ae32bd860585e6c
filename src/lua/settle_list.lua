-- settle_list: apply the outcomes of a batch of list messages. Ack last: a retry is
-- written back to the delay pool, or a dead letter pushed onto the queue's dead list,
-- before the message leaves the processing list (LREM), and only while it is still there,
-- so nothing is settled twice. A record whose destination key holds another type is left
-- in the processing list and reported; the others go on.
--
-- KEYS[1] pool ZSET, KEYS[2] data HASH, KEYS[3] the pool's jobs HASH (a retry keeps its
-- job id through the pool), then per queue: processing LIST, dead LIST, deliveries HASH
-- (the message's fetch count and its job's count of starts are cleared once it is
-- settled)
-- ARGV[1] consumer name, then records of 8 fields:
--   kind ('A' ack, 'R' retry, 'D' dead), queue index (0-based), queue name, job key,
--   message as delivered, retry message or reason, due score or event, attempts
-- Returns one code per record (1 settled, 2 settled as a dead letter because its retry
-- was superseded by a newer push of its key, 0 already gone, -1 left: a key of another
-- type), then {key, found, wanted} if any was -1.
local pool_bad = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
local blocked = nil
local out = {}
local now_s = server_s()
for i = 2, #ARGV, 8 do
  local kind, q = ARGV[i], tonumber(ARGV[i + 1])
  local processing, dead, deliveries = KEYS[4 + q * 3], KEYS[5 + q * 3], KEYS[6 + q * 3]
  local msg = ARGV[i + 4]
  local bad = wrong_type(processing, 'list', deliveries, 'hash')
  if not bad and kind == 'R' then bad = pool_bad end
  -- A retry whose key was pushed again meanwhile becomes a dead letter (see below): the
  -- key scheduled, or its data written by a push whose ZADD has not come yet.
  local superseded = not bad and kind == 'R' and pushed_again(KEYS[1], KEYS[2], ARGV[i + 3])
  if not bad and (kind == 'D' or superseded) then bad = wrong_type(dead, 'list') end
  local code
  if bad then
    code, blocked = -1, bad
  elseif not redis.call('LPOS', processing, msg) then
    code = 0
  else
    if superseded then
      -- The key was pushed again while this job ran, and a push reschedules its key: the
      -- newer push keeps the slot, this retry becomes a dead letter (nothing vanishes).
      local event, attempts = retry_facts(ARGV[i + 5])
      redis.call('LPUSH', dead, cjson.encode({
        msg = ARGV[i + 5], reason = SUPERSEDED, ts = now_s,
        event = event, key = ARGV[i + 3], attempts = attempts, consumer = ARGV[1],
        queue = ARGV[i + 2]
      }))
    elseif kind == 'R' then
      remember_job(KEYS[3], ARGV[i + 3], ARGV[i + 5])
      redis.call('HSET', KEYS[2], ARGV[i + 3], ARGV[i + 5])
      redis.call('ZADD', KEYS[1], ARGV[i + 6], ARGV[i + 3])
    elseif kind == 'D' then
      redis.call('LPUSH', dead, cjson.encode({
        msg = msg, reason = ARGV[i + 5], ts = now_s,
        event = ARGV[i + 6], key = ARGV[i + 3], attempts = tonumber(ARGV[i + 7]),
        consumer = ARGV[1], queue = ARGV[i + 2]
      }))
    end
    local digest = redis.sha1hex(msg)
    redis.call('HDEL', deliveries, digest, 'started:' .. digest)
    code = redis.call('LREM', processing, 1, msg)
    if superseded and code == 1 then code = 2 end
  end
  out[#out + 1] = code
end
if blocked then
  out[#out + 1] = blocked[1]; out[#out + 1] = blocked[2]; out[#out + 1] = blocked[3]
end
return out
