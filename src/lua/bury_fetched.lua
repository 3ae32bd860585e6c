-- bury_fetched: settles a list message that `fetch` stopped at because fetching it again
-- would be once more than the limit and its job started that often (it kills its
-- consumer, which restarts and pushes it back), by the caller's verdict after a look at the inbox: 'done' (its job's
-- transaction committed: its process was killed between the commit and the settle) takes
-- it off its queue without a letter; 'dead' pushes its dead letter, then takes it off.
-- Nothing happens unless it is still at its queue's tail and still over the limit, its
-- job's starts too (a peer fetched or settled it meanwhile).
--
-- KEYS[1] the queue, KEYS[2] its deliveries HASH, KEYS[3] its dead list
-- ARGV[1] the message, ARGV[2] 'done' or 'dead', ARGV[3] max deliveries, ARGV[4] this
-- consumer (recorded in the letter), ARGV[5] the queue's name, ARGV[6] max bytes
-- Returns {1 if taken off as done else 0, {its job key (or 'queue ' and the queue's name),
-- reason} if buried or {}, {key, found, wanted} or {}}.
local w = wrong_type(KEYS[1], 'list', KEYS[2], 'hash')
if w then return wrongtype_reply(w) end
local msg = ARGV[1]
if redis.call('LINDEX', KEYS[1], -1) ~= msg then return {0, {}, {}} end
local digest = redis.sha1hex(msg)
local count = tonumber(redis.call('HGET', KEYS[2], digest) or '0') + 1
local max = tonumber(ARGV[3])
local started = tonumber(redis.call('HGET', KEYS[2], 'started:' .. digest) or '0')
if count <= max or started < max then return {0, {}, {}} end
if ARGV[2] == 'done' then
  redis.call('HDEL', KEYS[2], digest, 'started:' .. digest)
  redis.call('RPOP', KEYS[1])
  return {1, {}, {}}
end
local dead_bad = wrong_type(KEYS[3], 'list')
if dead_bad then return {0, {}, dead_bad} end
-- Its fetch count may have been set back (fetches of a killed process that never ran it),
-- so the letter tells the starts: those counted, since its first fetch's is not.
local reason = 'its job started ' .. started .. ' times since its first fetch without being settled (limit ' ..
  max .. ')'
list_letter(KEYS[3], ARGV[5], msg, reason, started + 1, #msg, '', ARGV[4], tonumber(ARGV[6]),
  server_s())
redis.call('HDEL', KEYS[2], digest, 'started:' .. digest)
redis.call('RPOP', KEYS[1])
-- Named by its job key where it carries one (a message the mover moved), else by its queue.
local _, key = list_message_facts(msg)
if key == '' then key = 'queue ' .. ARGV[5] end
return {0, {key, reason}, {}}
