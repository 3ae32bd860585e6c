<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * The Lua scripts of Producer: the worker's own push and cancel (src/lua/push.lua,
 * cancel.lua with the type check of src/lua/prelude.lua), and three more of the same
 * shape. Each checks the types of the keys it will write before its first write (Redis
 * does not roll back a script that fails half-way) and answers an integer, or
 * {'WRONGTYPE', key, found, wanted}.
 *
 * @internal
 */
final class Scripts
{
    private const WRONG_TYPE = <<<'LUA'
local function wrong_type(...)
  local args = {...}
  for i = 1, #args, 2 do
    local t = redis.call('TYPE', args[i])['ok']
    if t ~= 'none' and t ~= args[i + 1] then
      return {'WRONGTYPE', args[i], t, args[i + 1]}
    end
  end
  return nil
end

LUA;

    /**
     * KEYS pool ZSET, data HASH, jobs HASH; ARGV job key, message, score. Data before
     * score, so the mover never sees a member without its message. 1 if the key was
     * already scheduled (a reschedule).
     */
    public const PUSH = self::WRONG_TYPE . <<<'LUA'
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
if w then return w end
local existed = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
if existed then return 1 else return 0 end
LUA;

    /**
     * KEYS pool, data, jobs; ARGV job key. Score first, then the data and the retry
     * record. 1 if the job was there.
     */
    public const CANCEL = self::WRONG_TYPE . <<<'LUA'
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash')
if w then return w end
local a = redis.call('ZREM', KEYS[1], ARGV[1])
local b = redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if a + b > 0 then return 1 else return 0 end
LUA;

    /** KEYS pool; ARGV job key, score. Only a scheduled key moves. 1 if it was there. */
    public const RESCHEDULE = self::WRONG_TYPE . <<<'LUA'
local w = wrong_type(KEYS[1], 'zset')
if w then return w end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
LUA;

    /**
     * KEYS legacy pool ZSET, member STRING; ARGV order id, score. The STRING before the
     * member. 1 if the member was already scheduled.
     */
    public const PUSH_LEGACY = self::WRONG_TYPE . <<<'LUA'
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'string')
if w then return w end
local existed = redis.call('ZSCORE', KEYS[1], KEYS[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], KEYS[2])
if existed then return 1 else return 0 end
LUA;

    /**
     * KEYS legacy pool, member. The member first, then its STRING (a key of another type
     * is not the pool's and stays). 1 if either was there.
     */
    public const CANCEL_LEGACY = self::WRONG_TYPE . <<<'LUA'
local w = wrong_type(KEYS[1], 'zset', KEYS[2], 'string')
if w then return w end
local a = redis.call('ZREM', KEYS[1], KEYS[2])
local b = redis.call('DEL', KEYS[2])
if a + b > 0 then return 1 else return 0 end
LUA;
}
