-- requeue_processing: push a consumer's processing lists back onto their queues.
-- Newest first onto the tail of the queue, so the oldest ends at the tail and is taken
-- first again: order is kept as far as it can be. Each message moves with one LMOVE (in
-- its new place the moment it leaves the old one). One atomic step, so when several
-- consumers notice the same dead peer, exactly one moves its messages.
--
-- A peer that is alive but has had no usable PostgreSQL for a while (its `no-database`
-- key exists) has its lists pushed back too, by a caller that has a usable one: its
-- workers cannot run them. It stays in the SET. Its fetch of each message it gives back
-- is taken off the message's delivery count: no handler could run it there, so that fetch
-- says nothing of the message itself (found from outside: a peer whose database kept
-- going read-only fetched the same messages once a cycle, and good jobs became dead
-- letters "fetched 3 times without being settled"). A dead peer's fetches still count:
-- a message that kills its consumer looks just like that.
--
-- KEYS: processing 1, queue 1, deliveries HASH 1, processing 2, ..., consumers SET,
-- heartbeat key, no-database key
-- ARGV[1] consumer name, ARGV[2] '1' if the consumer is a peer (checked here against its
-- heartbeat, and forgotten from the SET when dead), '0' for our own lists at start,
-- ARGV[3] '1' if the caller has had a usable PostgreSQL for a while (a dead peer's lists
-- are pushed back by any caller: they go back to the queues, for whichever consumer
-- fetches them).
-- Returns {messages pushed back, 1 if the peer is alive without a database}, or -1 if
-- the peer keeps them (alive, and with a usable PostgreSQL or asked by a caller that has
-- none).
local nk = #KEYS
local checks = {}
for i = 1, nk - 3, 3 do
  checks[#checks + 1] = KEYS[i]; checks[#checks + 1] = 'list'
  checks[#checks + 1] = KEYS[i + 1]; checks[#checks + 1] = 'list'
end
checks[#checks + 1] = KEYS[nk - 2]; checks[#checks + 1] = 'set'
local w = wrong_type(unpack(checks))
if w then return wrongtype_reply(w) end
local peer = ARGV[2] == '1'
local alive = peer and redis.call('EXISTS', KEYS[nk - 1]) == 1
if alive and not (ARGV[3] == '1' and redis.call('EXISTS', KEYS[nk]) == 1) then
  return -1
end
local moved = 0
for i = 1, nk - 3, 3 do
  while true do
    local msg = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
    if not msg then break end
    moved = moved + 1
    if alive then forgive_fetch(KEYS[i + 2], msg) end
  end
end
if peer and not alive then redis.call('SREM', KEYS[nk - 2], ARGV[1]) end
return {moved, alive and 1 or 0}
