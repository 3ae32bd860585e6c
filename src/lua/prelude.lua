-- Prepended to every script of the store (src/store/mod.rs). Redis does not roll back a
-- script that fails half-way, so each script checks the types of the keys it will write
-- before its first write, writes the message into its next place, and removes it from
-- where it was (ack, ZREM, LREM, XDEL) last: a failure at any point leaves it there.
--
-- A script that cannot run at all because of a key's type returns
-- {'WRONGTYPE', key, found, wanted} instead of its reply; every other reply of the store's
-- scripts starts with an integer.

-- The first key of (key, type, key, type, ...) that exists with another type, as
-- {key, found, wanted}; nil when all are absent or of their type.
local function wrong_type(...)
  local args = {...}
  for i = 1, #args, 2 do
    local t = redis.call('TYPE', args[i])['ok']
    if t ~= 'none' and t ~= args[i + 1] then
      return {args[i], t, args[i + 1]}
    end
  end
  return nil
end

-- Redis's own clock in unix seconds: when a dead letter died (its `ts`). Every time a
-- script records is the server's, never a worker host's (docs/design.md, Time).
local function server_s()
  return tonumber(redis.call('TIME')[1])
end

local function wrongtype_reply(w)
  return {'WRONGTYPE', w[1], w[2], w[3]}
end

local function json_string(s)
  return '"' .. string.gsub(s, '[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == '\\' then return '\\\\' end
    return string.format('\\u%04x', string.byte(c))
  end) .. '"'
end

-- The job id the mover stamps as a message's first field: `{"job_id":"<digits and dashes>"`
-- (`<due µs>-<a>-<b>`, the job's identity, see move_due.lua; `<µs>-<n>` from older
-- movers). Only this exact prefix counts; a `job_id` anywhere else is a field like any other.
local function stamped_id(msg)
  return string.match(msg, '^{"job_id":"([%d%-]+)"[,}]')
end

-- The record that lets a retry keep its job identity through the pool: "<id> <sha1 of
-- the message>" under the job key in the pool's jobs HASH, id `-` for a message that had
-- no stamp (one written straight into the stream or a list queue, whose identity is its
-- key and ts: it must stay unstamped). The mover keeps the id only if the data it moves
-- is that very message, so a producer pushing the key again (even a copy of an old
-- message) gets the id of what it pushed.
-- Beside the record, under `msg\n<job key>`, a copy of the message itself: a producer
-- that pushes the key again overwrites the data, and the retry it replaces is then a dead
-- letter with its message, which can be requeued as the same job (found from outside: the
-- letter held no message and its job's payload was nowhere). Removed with the record.
local function copy_field(key)
  return 'msg\n' .. key
end

local function remember_job(jobs, key, msg)
  local id = stamped_id(msg) or '-'
  redis.call('HSET', jobs, key, id .. ' ' .. redis.sha1hex(msg), copy_field(key), msg)
end

-- The two small indexes `worker trace` answers from without scanning a stream (the
-- pool's `moved` and `letters` HASHes, see keys.rs), kept in the round trips that move,
-- settle and bury messages, and by the requeue and purge of dead letters:
-- `moved`: job key -> id of the stream entry its latest move wrote, until that entry is
-- settled (acknowledged, retried or dead-lettered); `letters`: job key -> the ids of its
-- newest dead letters (at most LETTERS_KEPT, oldest first), until they are requeued or
-- purged. Each is at most one field per job key still moving or dead. Advisory: their
-- commands run under redis.pcall, so an index key of another type never holds a message
-- back (trace then reads less).
local LETTERS_KEPT = 8

-- Both are kept a batch at a time: the move script gathers its {key, id, ...} and
-- writes them with one HSET, the settle script unindexes its entries with one HMGET and
-- one HDEL, instead of a command or two per message.
local INDEX_CHUNK = 500

-- Calls `f` with the items of `list`, `size` of them at a time: a command's arguments
-- stay within what `unpack` can pass however long the list.
local function in_chunks(list, size, f)
  for i = 1, #list, size do f(unpack(list, i, math.min(i + size - 1, #list))) end
end

local function index_moves(moved, pairs)
  in_chunks(pairs, 2 * INDEX_CHUNK, function(...) redis.pcall('HSET', moved, ...) end)
end

-- Only the entries the index names: a newer move of a key keeps its own. `pairs` is
-- {key, id, ...}.
local function unindex_moves(moved, pairs)
  for i = 1, #pairs, 2 * INDEX_CHUNK do
    local keys, ids = {}, {}
    for j = i, math.min(i + 2 * INDEX_CHUNK - 1, #pairs), 2 do
      if pairs[j] and pairs[j] ~= '' then
        keys[#keys + 1] = pairs[j]
        ids[#ids + 1] = pairs[j + 1]
      end
    end
    if #keys > 0 then
      local now = redis.pcall('HMGET', moved, unpack(keys))
      if type(now) == 'table' then
        local gone = {}
        for j = 1, #keys do
          if now[j] == ids[j] then gone[#gone + 1] = keys[j] end
        end
        if #gone > 0 then redis.pcall('HDEL', moved, unpack(gone)) end
      end
    end
  end
end

local function unindex_move(moved, key, id)
  unindex_moves(moved, {key, id})
end

-- The field that says a key has had letters the index no longer names (more than
-- LETTERS_KEPT): `older\n<job key>` (a job key is never such a field, as in the jobs
-- HASH's copies). A requeue then looks in the dead letters themselves.
local function older_letters_field(key)
  return 'older\n' .. key
end

local function index_letter(letters, key, id)
  if not key or key == '' then return end
  local ids = {}
  local old = redis.pcall('HGET', letters, key)
  if type(old) == 'string' then
    for i in string.gmatch(old, '%S+') do ids[#ids + 1] = i end
  end
  ids[#ids + 1] = id
  local dropped = false
  while #ids > LETTERS_KEPT do
    table.remove(ids, 1)
    dropped = true
  end
  if dropped then
    redis.pcall('HSET', letters, key, table.concat(ids, ' '), older_letters_field(key), '1')
  else
    redis.pcall('HSET', letters, key, table.concat(ids, ' '))
  end
end

local function unindex_letter(letters, key, id)
  if not key or key == '' then return end
  local old = redis.pcall('HGET', letters, key)
  if type(old) ~= 'string' then return end
  local ids = {}
  for i in string.gmatch(old, '%S+') do
    if i ~= id then ids[#ids + 1] = i end
  end
  if #ids == 0 then
    redis.pcall('HDEL', letters, key)
  else
    redis.pcall('HSET', letters, key, table.concat(ids, ' '))
  end
end

-- The event and the attempts so far of a retry message (its `retry`, already raised),
-- for the dead letter of a retry that a newer push superseded; '' and 0 for a message
-- that does not decode.
local function retry_facts(msg)
  local ok, v = pcall(cjson.decode, msg)
  if not ok or type(v) ~= 'table' then return '', 0 end
  local event, retry = v['event'], tonumber(v['retry'])
  if type(event) ~= 'string' then event = '' end
  if not retry or retry < 0 then retry = 0 end
  return event, math.floor(retry)
end

-- Whether a job key was pushed again while its job ran: it is scheduled, or its data is
-- there without it (a producer's HSET whose ZADD has not come yet: the mover takes a
-- key's data when it moves it, so none is left while its job runs). A retry written back
-- then would overwrite the newer push's data (found from outside: a producer pausing
-- between HSET and ZADD lost its push to the retry, silently).
local function pushed_again(pool, data, key)
  return redis.call('ZSCORE', pool, key) or redis.call('HEXISTS', data, key) == 1
end

-- Why a retry is a dead letter when its job key was pushed again before it ran.
local SUPERSEDED = 'retry superseded: the job key was pushed again before the retry ran ' ..
  '(a push reschedules its key; the newer push runs)'

-- How much of an oversized message its dead letter keeps.
local OVERSIZE_PREFIX = 4096

-- Fields of the dead letter of a message over the size limit: a prefix, its length and a
-- digest, never a full copy.
local function oversize_reason(len, limit)
  return 'message too large: ' .. len .. ' bytes, limit ' .. limit
end

-- The fields `msg` and `key` of a stream entry's field list.
local function entry_fields(fields)
  local msg, key = '', nil
  for i = 1, #fields, 2 do
    if fields[i] == 'msg' then msg = fields[i + 1] elseif fields[i] == 'key' then key = fields[i + 1] end
  end
  return msg, key
end

-- Forgets the counted starts (KEYS[5], the pool's `starts` HASH) of entries gone from the
-- stream while pending, which no settle will clear; under pcall: a key of another type
-- keeps nothing from being read.
local function forget_starts(ids)
  in_chunks(ids, INDEX_CHUNK, function(...) redis.pcall('HDEL', KEYS[5], ...) end)
end

-- Screens stream entries read or claimed by this script, before they reach the worker:
-- an entry whose stream entry is gone (deleted while pending) is acknowledged and
-- counted; one whose message is over the size limit goes to the dead letters (a prefix,
-- its length and a digest) and is then acknowledged and deleted from the stream. While the dead-letter key holds
-- another type, an oversized entry stays pending, undelivered, and that key is reported.
-- Returns the entries to deliver, the count of gone ones, {key, reason, ...} of the
-- buried ones and {key, found, wanted} (empty when none) of a key that blocked one.
-- KEYS[1] must be the stream, KEYS[2] the dead-letter stream, KEYS[3] and KEYS[4] the
-- pool's `moved` and `letters` indexes, KEYS[5] its `starts` HASH.
local function screen(entries, group, consumer, max_bytes, now_s)
  local kept, buried, gone = {}, {}, 0
  local dead_bad = wrong_type(KEYS[2], 'stream')
  local blocked = {}
  for _, e in ipairs(entries) do
    local id, fields = e[1], e[2]
    if not fields or #fields == 0 then
      redis.call('XACK', KEYS[1], group, id)
      forget_starts({id})
      gone = gone + 1
    else
      local msg, key = entry_fields(fields)
      key = key or id
      if #msg > max_bytes and dead_bad then
        blocked = dead_bad
      elseif #msg > max_bytes then
        local reason = oversize_reason(#msg, max_bytes)
        local letter = redis.call('XADD', KEYS[2], '*', 'msg', string.sub(msg, 1, OVERSIZE_PREFIX),
          'reason', reason, 'ts', now_s, 'event', '', 'key', key, 'attempts', 0,
          'length', #msg, 'sha1', redis.sha1hex(msg), 'consumer', consumer, 'id', id)
        unindex_move(KEYS[3], key, id)
        index_letter(KEYS[4], key, letter)
        redis.call('XACK', KEYS[1], group, id)
        -- Written by someone else (our mover never writes one): its bytes leave Redis
        -- too, not after the retention.
        redis.call('XDEL', KEYS[1], id)
        buried[#buried + 1] = key
        buried[#buried + 1] = reason
      else
        kept[#kept + 1] = e
      end
    end
  end
  return kept, gone, buried, blocked
end

-- XCLAIM (JUSTID, idle at least `min_idle` ms) to `consumer` of the XPENDING `entries`
-- ({id, consumer, idle, count} each), each keeping its delivery count, or with one
-- delivery taken off when `forgive` (a delivery to a process that could not run it: see
-- take_over and forgive). Returns the ids claimed.
local function claim_counted(stream, group, consumer, min_idle, entries, forgive)
  local by_count, counts = {}, {}
  for _, e in ipairs(entries) do
    local n = -1
    if forgive then n = math.max(tonumber(e[4]) - 1, 0) end
    if not by_count[n] then
      by_count[n] = {}
      counts[#counts + 1] = n
    end
    table.insert(by_count[n], e[1])
  end
  local claimed = {}
  for _, n in ipairs(counts) do
    local args = {stream, group, consumer, min_idle}
    for _, id in ipairs(by_count[n]) do args[#args + 1] = id end
    if n >= 0 then
      args[#args + 1] = 'RETRYCOUNT'
      args[#args + 1] = n
    end
    args[#args + 1] = 'JUSTID'
    for _, id in ipairs(redis.call('XCLAIM', unpack(args))) do claimed[#claimed + 1] = id end
  end
  return claimed
end

-- One fetch of list message `msg` taken off its count in the `deliveries` HASH (a fetch by
-- a consumer that could not run it: see requeue_processing and forgive_list). Under pcall:
-- a key of another type leaves the counts as they are.
local function forgive_fetch(deliveries, msg)
  local digest = redis.sha1hex(msg)
  local c = tonumber(redis.pcall('HGET', deliveries, digest))
  if c and c > 1 then
    redis.call('HSET', deliveries, digest, c - 1)
  elseif c then
    redis.call('HDEL', deliveries, digest)
  end
end

-- The event and job key of a whole list message, for its letter (a message the mover
-- moved carries its `job_key`): '' where it has none or is not JSON (found from outside:
-- a poison message's letter named neither, so `worker trace` of its key found nothing).
local function list_message_facts(msg)
  local ok, m = pcall(cjson.decode, msg)
  if not ok or type(m) ~= 'table' then return '', '' end
  local event, key = m['event'], m['job_key']
  if type(event) ~= 'string' then event = '' end
  if type(key) ~= 'string' then key = '' end
  return event, key
end

-- Pushes the dead letter of list message `msg` (or its prefix, when `length` is over
-- `max_bytes`) of queue `queue` onto `dead`.
local function list_letter(dead, queue, msg, reason, attempts, length, digest, consumer,
    max_bytes, now_s)
  local event, key = '', ''
  if length <= max_bytes then event, key = list_message_facts(msg) end
  redis.call('LPUSH', dead, cjson.encode({
    msg = msg, ts = now_s, consumer = consumer, queue = queue, reason = reason,
    event = event, key = key, attempts = attempts, length = length, sha1 = digest
  }))
end
