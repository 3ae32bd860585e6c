-- take_over: move every pending entry of a consumer whose heartbeat key has expired to
-- this consumer, without reading them (JUSTID: no content, no delivery counted). The
-- caller then delivers them as its own pending, as the channel has room. Checked against
-- the heartbeat here, so a peer that is alive after all keeps its work; when several
-- consumers notice the same dead peer, each entry moves once (MIN-IDLE: an entry a peer
-- has just claimed is skipped). A dead consumer that owes nothing is forgotten.
--
-- A peer that is alive but has had no usable PostgreSQL for a while (its `no-database`
-- key exists) gives up its pending entries the same way, to a caller that has a usable
-- one (ARGV[5] '1'): its workers cannot run them, and a healthy process would otherwise
-- get them only after --claim-idle. Such a peer is not forgotten by the group. Its
-- delivery of each entry it gives up is taken off the entry's delivery count: no handler
-- could run it there, so that delivery says nothing of the entry itself (found from
-- outside: a peer whose database kept going read-only took the same jobs again each
-- cycle, and good jobs became dead letters for too many deliveries). A dead peer's
-- deliveries still count: an entry that kills its consumer looks just like that.
--
-- A dead peer's entries are taken only by a caller that can use PostgreSQL now (ARGV[6]
-- '1'): in one that cannot they would only wait, and then be taken from it again.
--
-- KEYS[1] events STREAM, KEYS[2] the peer's heartbeat key, KEYS[3] its no-database key
-- ARGV[1] group, ARGV[2] this consumer, ARGV[3] the peer, ARGV[4] most ids per call,
-- ARGV[5] '1' if this consumer has had a usable PostgreSQL for a while, ARGV[6] '1' if it
-- has one now
-- Returns {-1} if the peer keeps its entries (alive and with a usable PostgreSQL, or this
-- consumer cannot take them),
-- else {claimed, alive, id, id, ...} (alive 1: the peer lives without a database);
-- fewer than ARGV[4] claimed means the peer owes nothing more.
local w = wrong_type(KEYS[1], 'stream')
if w then return wrongtype_reply(w) end
local alive = redis.call('EXISTS', KEYS[2]) == 1
if alive and not (ARGV[5] == '1' and redis.call('EXISTS', KEYS[3]) == 1) then
  return {-1}
end
if not alive and ARGV[6] ~= '1' then return {-1} end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', 1000, '-', '+', ARGV[4], ARGV[3])
-- Each keeps its delivery count from a dead peer, one fewer from a live one.
local out = {0, alive and 1 or 0}
for _, id in ipairs(claim_counted(KEYS[1], ARGV[1], ARGV[2], 1000, p, alive)) do
  out[#out + 1] = id
end
out[1] = #out - 2
if not alive and #p < tonumber(ARGV[4]) and
    #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[3]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[3])
end
return out
