-- requeue: dead letters back into the delay pool, each in one step with its XDEL.
-- Each letter is re-read by id here, inside the script: one that a concurrent requeue
-- or purge already removed is skipped, so a letter requeued twice goes back once. (The
-- caller computed the message from the same id; stream entries never change, so the
-- id pins the content.)
-- A job key that is scheduled again (its producer pushed it anew since it died) is left
-- alone: the newer message wins, and the letter stays for the operator to purge. So is a
-- letter when the `letters` index names a newer letter of its key that is still there (a
-- retry a newer push replaced, then that push's own job): the newer one goes back, in this
-- call or another (found from outside: requeued a page at a time, the older job went back
-- first and the newer push's letter was left behind its key).
--
-- KEYS[1] dead STREAM, KEYS[2] pool ZSET, KEYS[3] data HASH, KEYS[4] the pool's jobs HASH
-- (a requeued letter stays the same job: its stamp is remembered, as for a retry),
-- KEYS[5] the pool's `letters` index (see the prelude)
-- ARGV[1] due score (unix ms), then triples: dead-letter id, job key, message
-- Data and score are written before the XDEL (ack last).
-- Returns one code per triple: 1 requeued, 0 gone, -1 job key scheduled again (or a newer
-- letter of it dead), -2 its data there with no schedule.
local w = wrong_type(KEYS[1], 'stream', KEYS[2], 'zset', KEYS[3], 'hash', KEYS[4], 'hash')
if w then return wrongtype_reply(w) end
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms) or 0, tonumber(seq) or 0
end
local function later(a, b)
  local am, as = id_parts(a)
  local bm, bs = id_parts(b)
  return am > bm or (am == bm and as > bs)
end
-- How many dead letters after a letter are looked through for a newer one of its key, when
-- the key has had more than the index keeps; past that, one is taken to be there.
local SCAN_AT_MOST = 10000

-- A newer letter of `key` than `id` is still in the dead letters (the index is advisory:
-- read under pcall, each id it names checked in the stream). A key that has had more
-- letters than the index keeps is looked for in the letters after `id` themselves (found
-- from outside: its newer letters requeued or purged, an older one went back while one
-- past the index was still dead).
local function newer_letter(key, id)
  local ids = redis.pcall('HGET', KEYS[5], key)
  if type(ids) == 'string' then
    for other in string.gmatch(ids, '%S+') do
      if later(other, id) and #redis.call('XRANGE', KEYS[1], other, other) > 0 then
        return true
      end
    end
  end
  if redis.pcall('HEXISTS', KEYS[5], older_letters_field(key)) ~= 1 then return false end
  local from, seen = '(' .. id, 0
  while seen < SCAN_AT_MOST do
    local page = redis.call('XRANGE', KEYS[1], from, '+', 'COUNT', 500)
    if #page == 0 then return false end
    for _, e in ipairs(page) do
      local f = e[2]
      for j = 1, #f, 2 do
        if f[j] == 'key' and f[j + 1] == key then return true end
      end
    end
    seen = seen + #page
    from = '(' .. page[#page][1]
  end
  return true
end
local out = {}
for i = 2, #ARGV, 3 do
  local id, key, msg = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
    out[#out + 1] = 0
  elseif redis.call('ZSCORE', KEYS[2], key) or newer_letter(key, id) then
    out[#out + 1] = -1
  elseif redis.call('HEXISTS', KEYS[3], key) == 1 then
    -- Data with no schedule: a push under way (between its HSET and its ZADD), or one cut
    -- there and never finished. Either way not the letter's to overwrite.
    out[#out + 1] = -2
  else
    -- Data before score, as push.lua: the mover never sees a member without data.
    remember_job(KEYS[4], key, msg)
    redis.call('HSET', KEYS[3], key, msg)
    redis.call('ZADD', KEYS[2], ARGV[1], key)
    redis.call('XDEL', KEYS[1], id)
    unindex_letter(KEYS[5], key, id)
    out[#out + 1] = 1
  end
end
return out
