-- bury_overdelivered: entries delivered more than `max` times without being acknowledged
-- (a message that keeps killing its consumer) go to the dead letters, read and written
-- here so the worker never runs them again: the dead letter first, the XACK last.
--
-- Only an entry whose job started as often as the limit without being settled is taken
-- for one: the workers count each transaction of a job delivered before that its process
-- did not see end (the pool's `starts` HASH; a first delivery's start is not counted,
-- so a poison message runs once more than the limit: one held unrun at a kill must not
-- be taken for one). One read more often than that was held unrun by processes killed
-- meanwhile (read ahead, waiting for its `--max-rate` slot): no fault of its own, so its
-- delivery count goes back to its starts (its consumer and idle time kept) and it stays
-- pending.
--
-- Two calls. The first ('look') names the poison ones: {id, job key, message ('' when
-- over the size limit), delivery count} each. The caller looks their jobs up in the inbox: a job
-- whose transaction committed (its process was killed between the commit and the ack,
-- as often as the limit) is done, not a poison message, and is never also a dead letter.
-- The second ('settle') takes the caller's verdict for each id it looked at: 'done' is
-- acknowledged, 'dead' buried; an entry no longer pending as over-delivered (settled or
-- claimed meanwhile) is left alone, and one not named waits for the next look.
--
-- KEYS[1] events STREAM, KEYS[2] dead STREAM, KEYS[3] and KEYS[4] the pool's `moved` and
-- `letters` indexes (see the prelude), KEYS[5] the pool's `starts` HASH
-- ARGV[1] group, ARGV[2] only this consumer's entries ('' for all), ARGV[3] min idle (ms),
-- ARGV[4] max deliveries, ARGV[5] max bytes, ARGV[6] most entries looked at,
-- ARGV[7] this consumer (recorded in the letter), ARGV[8] 'look' or 'settle',
-- then for 'settle' (id, 'done' or 'dead') pairs
-- While the dead-letter key or the `starts` key holds another type nothing is buried (the
-- entries stay pending) and the key is reported.
-- Returns for 'look' {{{id, key, message, count}, ...}, {key, found, wanted} or {},
-- counts set back} (the dead-letter key's type is looked at on every call, so that a pass
-- that met none proves it fixed); for 'settle' {buried, {key, reason, ...}, {key, found,
-- wanted} or {}, acknowledged as done}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local max = tonumber(ARGV[4])
local max_bytes = tonumber(ARGV[5])

-- The pending records {id, consumer, idle, count} from `from` to `to` (at most `n`) that
-- the filters let through.
local function pending(from, to, n)
  local args = {KEYS[1], ARGV[1]}
  if tonumber(ARGV[3]) > 0 then args[#args + 1] = 'IDLE'; args[#args + 1] = ARGV[3] end
  args[#args + 1] = from; args[#args + 1] = to; args[#args + 1] = n
  if ARGV[2] ~= '' then args[#args + 1] = ARGV[2] end
  return redis.call('XPENDING', unpack(args))
end

-- How often the job of entry `id` started again after its first delivery without being
-- settled.
local function starts(id)
  return tonumber(redis.call('HGET', KEYS[5], id)) or 0
end

-- While the `starts` key holds another type no entry over the limit can be told from one
-- killed processes held unrun (found from outside: the delivery count alone made good
-- jobs that never ran dead letters): none is buried or set back, they wait, and the key
-- is reported.
local starts_bad = wrong_type(KEYS[5], 'hash')

if ARGV[8] == 'look' then
  local out = {}
  local forgiven = 0
  for _, p in ipairs(pending('-', '+', ARGV[6])) do
    local started = p[4] > max and (starts_bad and max or starts(p[1]))
    if started and started < max then
      redis.call('XCLAIM', KEYS[1], ARGV[1], p[2], 0, p[1], 'IDLE', p[3], 'RETRYCOUNT', started,
        'JUSTID')
      forgiven = forgiven + 1
    elseif started then
      local r = redis.call('XRANGE', KEYS[1], p[1], p[1])
      if #r > 0 then
        local msg, key = entry_fields(r[1][2])
        if #msg > max_bytes then msg = '' end
        out[#out + 1] = {p[1], key or p[1], msg, p[4]}
      else
        -- Gone from the stream while pending: nothing to look up, nothing to bury.
        out[#out + 1] = {p[1], p[1], '', p[4]}
      end
    end
  end
  return {out, wrong_type(KEYS[2], 'stream') or starts_bad or {}, forgiven}
end

local dead_bad = wrong_type(KEYS[2], 'stream') or starts_bad
if dead_bad then return {0, {}, dead_bad, 0} end
local out = {}
local done = 0
for i = 9, #ARGV, 2 do
  local id, verdict = ARGV[i], ARGV[i + 1]
  local p = pending(id, id, 1)[1]
  local started = p and p[4] > max and starts(id)
  if started and started >= max then
    redis.pcall('HDEL', KEYS[5], id)
    local r = redis.call('XRANGE', KEYS[1], id, id)
    if #r > 0 then
      local msg, key = entry_fields(r[1][2])
      key = key or id
      if verdict == 'done' then
        unindex_move(KEYS[3], key, id)
        done = done + 1
      else
        local count = p[4]
        local event = ''
        local ok, v = pcall(cjson.decode, msg)
        if ok and type(v) == 'table' and type(v.event) == 'string' then event = v.event end
        local reason = 'delivered ' .. count .. ' times, its job started ' .. started ..
          ' times since its first delivery, without being acknowledged (limit ' .. max .. ')'
        local length, digest = #msg, ''
        if #msg > max_bytes then
          digest = redis.sha1hex(msg)
          msg = string.sub(msg, 1, OVERSIZE_PREFIX)
        end
        local letter = redis.call('XADD', KEYS[2], '*', 'msg', msg, 'reason', reason,
          'ts', server_s(), 'event', event, 'key', key, 'attempts', count, 'length', length,
          'sha1', digest, 'consumer', ARGV[7], 'id', id)
        unindex_move(KEYS[3], key, id)
        index_letter(KEYS[4], key, letter)
        out[#out + 1] = key
        out[#out + 1] = reason
      end
    end
    redis.call('XACK', KEYS[1], ARGV[1], id)
  end
end
return {#out / 2, out, {}, done}
