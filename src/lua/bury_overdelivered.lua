-- bury_overdelivered: entries delivered more than `max` times without being acknowledged
-- (a message that keeps killing its consumer) go to the dead letters, read and written
-- here so the worker never holds them: the dead letter first, the XACK last.
--
-- KEYS[1] events STREAM, KEYS[2] dead STREAM, KEYS[3] and KEYS[4] the pool's `moved` and
-- `letters` indexes (see the prelude)
-- ARGV[1] group, ARGV[2] only this consumer's entries ('' for all), ARGV[3] min idle (ms),
-- ARGV[4] max deliveries, ARGV[5] max bytes, ARGV[6] most entries looked at,
-- ARGV[7] this consumer (recorded in the letter)
-- While the dead-letter key holds another type nothing is buried (the entries stay
-- pending) and the key is reported.
-- Returns {buried, {key, reason, ...}, {key, found, wanted} or {}}.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local dead_bad = wrong_type(KEYS[2], 'stream')
if dead_bad then return {0, {}, dead_bad} end
local args = {KEYS[1], ARGV[1]}
if tonumber(ARGV[3]) > 0 then args[#args + 1] = 'IDLE'; args[#args + 1] = ARGV[3] end
args[#args + 1] = '-'; args[#args + 1] = '+'; args[#args + 1] = ARGV[6]
if ARGV[2] ~= '' then args[#args + 1] = ARGV[2] end
local max = tonumber(ARGV[4])
local max_bytes = tonumber(ARGV[5])
local out = {}
for _, p in ipairs(redis.call('XPENDING', unpack(args))) do
  local id, count = p[1], p[4]
  if count > max then
    local r = redis.call('XRANGE', KEYS[1], id, id)
    if #r > 0 then
      local msg, key = entry_fields(r[1][2])
      key = key or id
      local event = ''
      local ok, v = pcall(cjson.decode, msg)
      if ok and type(v) == 'table' and type(v.event) == 'string' then event = v.event end
      local reason = 'delivered ' .. count .. ' times without being acknowledged (limit ' .. max .. ')'
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
    redis.call('XACK', KEYS[1], ARGV[1], id)
  end
end
return {#out / 2, out, {}}
