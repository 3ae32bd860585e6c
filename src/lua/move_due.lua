-- move_due: move up to `limit` due jobs from a delay pool to the stream or a list queue,
-- atomically. Any number of movers may call this at once: a member is read, appended and
-- removed inside one script, so no two calls can move the same member.
--
-- KEYS[1] pool ZSET, KEYS[2] data HASH, KEYS[3] target (events STREAM or queue LIST),
-- KEYS[4] dead letters (STREAM in stream mode, the queue's dead LIST in list mode),
-- KEYS[5] the pool's jobs HASH (job ids of retries waiting in the pool), KEYS[6] and KEYS[7]
-- the pool's `moved` and `letters` indexes (stream mode; see the prelude)
-- ARGV[1] '' to decide by Redis's own clock (TIME), as the worker always does; a time in
--         unix milliseconds decides by that instead (the tests' injected clock)
-- ARGV[2] limit
-- ARGV[3] orphan grace in milliseconds
-- ARGV[4] 'stream' (XADD msg, key, due) or 'list' (LPUSH msg with a "job_key" field added)
-- ARGV[5] '' for our pool; for a legacy pool, the event its members stand for: each member
--         is then a STRING key holding an order id, and the message is built here
--         ({"event": ARGV[5], "payload": {"order_id": <id>}}). On one server this script
--         scans the pool and reaches each member's key itself (undeclared, under
--         redis.pcall, so a key an ACL user may not touch is that member's problem alone).
--         On a Redis Cluster (ARGV[7] = 'declared') the caller reads the due members first
--         and declares their keys in KEYS[8..] (this script checks that each is still a due
--         member); members whose key is in another hash slot than the pool come in
--         ARGV[10..] instead: they can only be dead-lettered.
-- ARGV[6] the largest message in bytes (--max-message-bytes)
-- ARGV[7] 'declared' (see ARGV[5]) or ''
-- ARGV[8] how many entries the stream may hold that no reader has taken yet before this
--         call moves no more (--move-ahead; 0: no bound; list mode is not bounded),
--         ARGV[9] the consumer group whose unread entries (XINFO GROUPS `lag`) count.
--         Moving further ahead of the readers than they can use starts no job sooner: it
--         only takes Redis's core in one burst (a backlog moved whole in its first
--         second) from everything else on the host. A stream without the group (not
--         created yet), on a Redis before 7.0, or whose group's lag Redis cannot say for
--         now (an unread entry deleted by hand, until the readers have read past the
--         stream's end and a new entry) is not bounded: counting it as full would hold
--         the mover for good when the entry deleted was the last one.
--
-- One clock: a member is due when its score is at or before Redis's TIME, whatever the
-- clock of the worker host that calls this. The `ts` of dead letters is that time too; a
-- message built for a legacy pool has its member's due time as `ts` (see `fetch`).
--
-- Scores below 1e11 are unix seconds, the rest unix milliseconds. Seconds scores sort
-- before any millisecond score, so each kind is one score range.
--
-- Every message leaves with a `job_id` as its first field: the one its retry record in
-- the jobs HASH names when the data is exactly the retried message (a retry, a held job or
-- a requeued dead letter going round again), otherwise the job's identity computed here
-- from what the producer wrote and nothing else: the pool's name, the member, its score
-- and its data (for a legacy pool, the order id its STRING key holds). A move undone by a
-- failover or a Redis crash leaves all four as they were, so moving the member again,
-- by any mover, gives the same id, and the inbox knows the job; a push of the key with
-- other data or another due time, even within the same second, gives another. The id is
-- `<due time in unix µs>-<a>-<b>`: the first 64 bits of a SHA-1 of the four as two decimal
-- numbers. Digits and dashes only, the form every worker version reads as a stamp
-- (the older one was `<move time in µs>-<n>`, made from Redis's clock), and a time first,
-- which their readers take for when the job came out of the pool. A stamp already in the
-- data (a producer pushing a copy of a moved message) is replaced. A job is its key plus
-- this id (plus `ts`).
--
-- Members whose data has not arrived (inside the grace) or that cannot be buried stay in
-- the pool; the scan goes on past them, so they never hold back the members due after
-- them (at most ten batches' worth of members are looked at per call).
--
-- A member that cannot be moved is not left to block the others: one whose data is over
-- the size limit, whose legacy key holds another type or cannot be read (Redis refuses
-- the command: an ACL user whose key patterns leave that key out), or whose data never
-- arrived within the grace goes to the dead letters with its reason (an oversized
-- message as a prefix, its length and a digest), and then leaves the pool.
--
-- An error of a command on a legacy member's key is about that member alone: those
-- commands run under redis.pcall, and their error becomes the
-- member's dead letter (a read) or is reported (the DEL after a move) instead of ending
-- the script at that member, which would stop the pool there at every call.
--
-- A member without data past the grace, whose pool's data HASH does not exist at all, on
-- a server that has evicted keys since it started (INFO stats `evicted_keys`, read under
-- redis.pcall: a user refused it sees plain orphans), is not an orphan of a producer that
-- wrote ZADD before HSET: its data vanished (an evicting Redis removes a whole key). Its
-- dead letter says "lost data", with its due time, so that it is reported as such.
--
-- Returns {moved, skipped, next_due_ms or -1, {key, reason, ...} of the buried,
-- {key, found, wanted} or {}, {key, error, ...} of legacy keys Redis refused to delete,
-- the time (unix ms) it decided by, 1 if ARGV[8] cut this call short (the stream holds
-- as many unread entries as it may) else 0}.
-- `skipped` counts due members left in the pool: data not arrived yet (inside the
-- grace), or a burial blocked by a dead-letter key of another type (reported in the
-- fifth element). A legacy key that cannot be deleted stays as it is; its member has
-- left the pool all the same (moved once, or buried).
local t = redis.call('TIME')
local now_ms = tonumber(ARGV[1]) or (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local now_sec = math.floor(now_ms / 1000)
-- Score bounds as text: milliseconds, and seconds with three decimals (seconds scores).
local now_ms_bound = string.format('%d', now_ms)
local now_s_bound = string.format('%d.%03d', now_sec, now_ms - now_sec * 1000)
local now_ts = string.format('%d', now_sec)
local limit = tonumber(ARGV[2])
local grace = tonumber(ARGV[3])
local mode = ARGV[4]
local legacy = ARGV[5]
local max_bytes = tonumber(ARGV[6])

local target_type, dead_type = 'stream', 'stream'
if mode == 'list' then target_type, dead_type = 'list', 'list' end
local w
if legacy == '' then
  w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], target_type)
else
  w = wrong_type(KEYS[1], 'zset', KEYS[3], target_type)
end
if w then return wrongtype_reply(w) end
-- The dead letters are needed only for members that cannot be moved: while that key
-- holds another type, such a member stays in the pool (reported) and the rest moves.
local dead_bad = wrong_type(KEYS[4], dead_type)

-- How many more the target may take now (ARGV[8]).
local ahead = tonumber(ARGV[8]) or 0
local cut = 0
if ahead > 0 then
  local unread
  if mode == 'stream' and redis.call('EXISTS', KEYS[3]) == 1 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
      local name, lag
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'lag' then lag = g[j + 1] end
      end
      if name == ARGV[9] and type(lag) == 'number' then unread = lag end
    end
  end
  -- Whole batches only, so the readers still take (and the workers run) whole sets: none
  -- until a batch fits under the bound (a bound below one batch: what fits).
  if unread and unread + limit > ahead then
    if limit <= ahead then limit = 0 else limit = math.max(ahead - unread, 0) end
    cut = 1
  end
end
local blocked = {}

local moved, skipped = 0, 0
-- {job key, entry id, ...} of this call's moves, for the `moved` index.
local index = {}
local buried = {}
local undeleted = {}

-- The job key travels inside the message on a list (a list entry is one string).
local function with_job_key(msg, key)
  if string.sub(msg, 1, 1) ~= '{' or string.find(msg, '"job_key"', 1, true) then
    return msg
  end
  local rest = string.sub(msg, 2)
  local sep = ','
  if string.match(rest, '^%s*}') then sep = '' end
  return '{"job_key":' .. json_string(key) .. sep .. rest
end

local replaced

-- A score as text, the same whichever way it was read (ZRANGEBYSCORE's reply or
-- tonumber of ZSCORE's) and whichever Redis version formats it: whole numbers in full,
-- others with 17 significant digits.
local function score_text(score)
  -- A reply's whole number in plain digits (below 2^53) is already that text.
  if type(score) == 'string' and #score < 16 and string.find(score, '^[1-9]%d*$') then
    return score
  end
  local x = tonumber(score)
  if x == math.floor(x) and math.abs(x) < 2^53 then return string.format('%d', x) end
  return string.format('%.17g', x)
end

-- What every identity of this pool starts with (see `identity`).
local identity_head = 'dw-job-1\n' .. #KEYS[1] .. ':' .. KEYS[1] .. '\n'

-- The identity of the job the producer wrote: pool, member, score and data, each but the
-- last with its length in front so that no two of them run together.
local function identity(key, score, data, due)
  local h = redis.sha1hex(identity_head .. #key .. ':' .. key .. '\n' .. score_text(score) ..
    '\n' .. data)
  local due_us = math.max(0, math.min(math.floor(due), 9e12)) * 1000
  return string.format('%d-%d-%d', due_us, tonumber(string.sub(h, 1, 8), 16),
    tonumber(string.sub(h, 9, 16), 16))
end

-- The job id for the message of `key` (`data`: what its identity is computed from): its
-- retry record's when the data is exactly the retried message (`-`: it stays unstamped),
-- otherwise its identity.
-- A retry record that does not match the data means a producer pushed the key again
-- before the retry ran (a push reschedules its key): that retry is reported as a dead
-- letter (its message is gone; the letter names its job).
local function job_id_for(msg, key, score, data, due, rec)
  -- A legacy pool's members are always fresh messages; their retries wait in our pool,
  -- under our records, which a legacy member of the same key must not touch.
  if legacy ~= '' then return identity(key, score, data, due) end
  if rec then
    local at = string.find(rec, ' ', 1, true)
    if at and string.sub(rec, at + 1) == redis.sha1hex(msg) then return string.sub(rec, 1, at - 1) end
    if not dead_bad then
      replaced(key, string.sub(rec, 1, (at or 0) - 1), string.sub(rec, (at or #rec) + 1))
    end
  end
  return identity(key, score, data, due)
end

-- The message without a stamp of ours in front.
local function unstamped(msg)
  local old = stamped_id(msg)
  if not old then return msg end
  local rest = string.sub(msg, #'{"job_id":"' + #old + 2)
  if string.sub(rest, 1, 1) == ',' then rest = string.sub(rest, 2) end
  return '{' .. rest
end

local function with_job_id(msg, id)
  if id == '-' or string.sub(msg, 1, 1) ~= '{' then return msg end
  local rest = string.sub(msg, 2)
  local sep = ','
  if string.match(rest, '^%s*}') then sep = '' end
  return '{"job_id":"' .. id .. '"' .. sep .. rest
end

-- A command on a legacy member's own key: its reply, or nil and the error Redis gave.
local function on_member(cmd, key)
  local r = redis.pcall(cmd, key)
  if type(r) == 'table' and r.err then return nil, r.err end
  return r
end

local function unreadable(key, err)
  return 'legacy key ' .. key .. ' cannot be read: ' .. err
end

-- The member's message, or nil and why not: 'missing' (no data yet) or a reason to bury;
-- then what its identity is computed from (the message itself, or a legacy key's value).
-- For our pool `msg` is its data as the page's HMGET read it (`false` or nil: none).
-- A legacy message is built from the member's due time (its `ts`, in unix seconds), so
-- that moving it again after the move was undone builds the same message.
local function fetch(key, due, msg)
  if legacy == '' then
    if not msg then return nil, 'missing' end
    if #msg > max_bytes then return nil, oversize_reason(#msg, max_bytes), #msg end
    return msg, nil, nil, msg
  end
  local kt, err = on_member('TYPE', key)
  if err then return nil, unreadable(key, err) end
  kt = kt['ok']
  if kt == 'none' then return nil, 'missing' end
  if kt ~= 'string' then
    return nil, 'legacy job key holds a ' .. kt .. ', not a string with an order id'
  end
  local len
  len, err = on_member('STRLEN', key)
  if err then return nil, unreadable(key, err) end
  if len > max_bytes then return nil, oversize_reason(len, max_bytes), len end
  local id
  id, err = on_member('GET', key)
  if err then return nil, unreadable(key, err) end
  -- An integer goes in as a JSON number, without leading zeros (JSON has none: "00014"
  -- is order 14); anything else as a string, for the handler to refuse.
  local value = json_string(id)
  local sign, digits = string.match(id, '^(%-?)(%d+)$')
  if digits then value = sign .. (string.match(digits, '^0*(%d.*)$')) end
  local ts = string.format('%d', math.floor(math.max(0, math.min(due, 9e15)) / 1000))
  return '{"event":' .. json_string(legacy) .. ',"payload":{"order_id":' .. value ..
    '},"retry":0,"ts":' .. ts .. '}', nil, nil, id
end

-- Keys of our pool whose message has left (moved or buried), to forget and unschedule
-- once per page (`forget_page`); of those, the keys that had a retry record, whose copy
-- of the message goes with it.
local gone = {}
local recorded = {}

local function forget(key)
  if legacy == '' then
    gone[#gone + 1] = key
  else
    local _, err = on_member('DEL', key)
    if err then
      undeleted[#undeleted + 1] = key
      undeleted[#undeleted + 1] = err
    end
    redis.call('ZREM', KEYS[1], key)
  end
end

-- How many keys this server has evicted since it started; nil if it may not be asked.
local function evicted_keys()
  local info = redis.pcall('INFO', 'stats')
  if type(info) ~= 'string' then return nil end
  return tonumber(string.match(info, 'evicted_keys:(%d+)'))
end

-- The dead letter of a member that cannot be moved; for an oversized one a prefix, its
-- length and a digest.
local function bury(key, reason, len)
  if dead_bad then
    blocked = dead_bad
    return false
  end
  local msg, digest = '', ''
  if len then
    local full
    if legacy == '' then full = redis.call('HGET', KEYS[2], key) else full = on_member('GET', key) end
    if full then
      msg = string.sub(full, 1, OVERSIZE_PREFIX)
      digest = redis.sha1hex(full)
    end
  end
  if mode == 'list' then
    redis.call('LPUSH', KEYS[4], cjson.encode({
      msg = msg, reason = reason, ts = now_sec, event = legacy, key = key,
      attempts = 0, length = len or 0, sha1 = digest, consumer = 'mover'
    }))
  else
    local letter = redis.call('XADD', KEYS[4], '*', 'msg', msg, 'reason', reason, 'ts', now_ts,
      'event', legacy, 'key', key, 'attempts', 0, 'length', len or 0, 'sha1', digest,
      'consumer', 'mover')
    index_letter(KEYS[7], key, letter)
  end
  buried[#buried + 1] = key
  buried[#buried + 1] = reason
  return true
end

-- The dead letter of a retry a newer push replaced in the pool: with the retry's message,
-- from the copy its record keeps (none from a worker older than the copy, or one that
-- is not the recorded message: the letter then names the job only).
replaced = function(key, job_id, sha1)
  local reason = 'retry of job ' .. job_id .. ' replaced: the job key was pushed again ' ..
    'before the retry ran (a push reschedules its key; the newer push runs)'
  local msg = redis.call('HGET', KEYS[5], copy_field(key))
  if not msg or redis.sha1hex(msg) ~= sha1 then msg = '' end
  local event, attempts = retry_facts(msg)
  if event == '' then event = legacy end
  if mode == 'list' then
    redis.call('LPUSH', KEYS[4], cjson.encode({
      msg = msg, reason = reason, ts = now_sec, event = event, key = key,
      attempts = attempts, consumer = 'mover'
    }))
  else
    local letter = redis.call('XADD', KEYS[4], '*', 'msg', msg, 'reason', reason, 'ts', now_ts,
      'event', event, 'key', key, 'attempts', attempts, 'consumer', 'mover')
    index_letter(KEYS[7], key, letter)
  end
  buried[#buried + 1] = key
  buried[#buried + 1] = reason
end

-- Values of `hash` under `keys` (`false` where none), a chunk of keys per command.
local function values_of(hash, keys)
  local out = {}
  in_chunks(keys, INDEX_CHUNK, function(...)
    for _, v in ipairs(redis.call('HMGET', hash, ...)) do out[#out + 1] = v end
  end)
  return out
end

-- The data and retry records of the moved and buried members of our pool go, and they
-- leave the pool: one command each per chunk of keys.
local function forget_page()
  in_chunks(gone, INDEX_CHUNK, function(...)
    redis.call('HDEL', KEYS[2], ...)
    redis.call('HDEL', KEYS[5], ...)
    redis.call('ZREM', KEYS[1], ...)
  end)
  local copies = {}
  for _, key in ipairs(gone) do
    if recorded[key] then copies[#copies + 1] = copy_field(key) end
  end
  in_chunks(copies, INDEX_CHUNK, function(...) redis.call('HDEL', KEYS[5], ...) end)
  gone = {}
  recorded = {}
end

local function handle(items, scale)
  -- Our pool's messages and retry records (`false`: none), read a page at a time.
  local msgs, recs = {}, {}
  if legacy == '' then
    local keys = {}
    for i = 1, #items, 2 do keys[#keys + 1] = items[i] end
    msgs = values_of(KEYS[2], keys)
    recs = values_of(KEYS[5], keys)
  end
  for i = 1, #items, 2 do
    local key = items[i]
    if recs[(i + 1) / 2] then recorded[key] = true end
    local due = tonumber(items[i + 1]) * scale
    local msg, why, len, data = fetch(key, due, msgs[(i + 1) / 2])
    if msg then
      local id = job_id_for(msg, key, items[i + 1], data, due, recs[(i + 1) / 2])
      local body = unstamped(msg)
      if mode == 'list' then
        -- job_key inside, the stamp in front of everything.
        redis.call('LPUSH', KEYS[3], with_job_id(with_job_key(body, key), id))
      else
        local entry = redis.call('XADD', KEYS[3], '*', 'msg', with_job_id(body, id), 'key', key,
          'due', math.floor(due))
        index[#index + 1] = key
        index[#index + 1] = entry
      end
      forget(key)
      moved = moved + 1
    elseif why ~= 'missing' then
      if bury(key, why, len) then
        -- A legacy key of another type is the producer's, and one that cannot be read
        -- cannot be deleted either: left alone, only unscheduled.
        if len then forget(key) else redis.call('ZREM', KEYS[1], key) end
      else
        skipped = skipped + 1
      end
    elseif now_ms - due > grace then
      local why = 'no data ' .. math.floor(grace / 1000) .. 's after its due time'
      local evicted = legacy == '' and redis.call('EXISTS', KEYS[2]) == 0 and evicted_keys()
      if evicted and evicted > 0 then
        why = 'lost data: the message due at ' .. string.format('%d', due) .. ' (unix ms) ' ..
          'vanished: the data hash ' .. KEYS[2] .. ' no longer exists, and this Redis has ' ..
          'evicted ' .. evicted .. ' keys since it started (maxmemory-policy must be noeviction)'
      end
      if bury(key, why) then
        redis.call('ZREM', KEYS[1], key)
      else
        skipped = skipped + 1
      end
    else
      skipped = skipped + 1
    end
  end
  forget_page()
end

-- Due members page by page, from the front; those left in the pool (skipped) stay at the
-- front, so the next page starts after them.
local scan_left = limit * 10
local function drain(min, max, scale)
  local offset = 0
  while scan_left > 0 do
    local want = limit - moved - #buried / 2
    if want <= 0 then return end
    local items = redis.call('ZRANGEBYSCORE', KEYS[1], min, max, 'WITHSCORES', 'LIMIT', offset,
      math.min(want, scan_left))
    if #items == 0 then return end
    local before = skipped
    handle(items, scale)
    scan_left = scan_left - #items / 2
    offset = offset + skipped - before
  end
end
if ARGV[7] ~= 'declared' then
  drain('-inf', now_s_bound, 1000)
  drain('1e11', now_ms_bound, 1)
else
  for i = 10, #ARGV do
    local key = ARGV[i]
    if redis.call('ZSCORE', KEYS[1], key) then
      local reason = 'legacy key ' .. key .. ' is in another hash slot than its pool ' ..
        KEYS[1] .. ': on a Redis Cluster the producer must give it the hash tag of the pool'
      if bury(key, reason) then redis.call('ZREM', KEYS[1], key) else skipped = skipped + 1 end
    end
  end
  for i = 8, #KEYS do
    if moved + #buried / 2 >= limit then break end
    local key = KEYS[i]
    local score = redis.call('ZSCORE', KEYS[1], key)
    if score then
      score = tonumber(score)
      local scale = 1
      if score < 1e11 then scale = 1000 end
      if score * scale <= now_ms then handle({key, score}, scale) end
    end
  end
end

if #index > 0 then index_moves(KEYS[6], index) end

-- The earliest member not yet due, so the caller can sleep exactly until then.
local next_due = -1
local s = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_s_bound, '(1e11', 'WITHSCORES', 'LIMIT', 0, 1)
if #s > 0 then next_due = tonumber(s[2]) * 1000 end
local m = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms_bound, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if #m > 0 then
  local d = tonumber(m[2])
  if next_due < 0 or d < next_due then next_due = d end
end
-- Lua numbers become integers in the reply; keep absurd scores (1e300, inf) in range.
if next_due > 9e15 then next_due = 9e15 end

return {moved, skipped, next_due, buried, blocked, undeleted, now_ms, cut}
