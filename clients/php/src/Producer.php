<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * Schedules, cancels and reschedules delay-worker jobs on a phpredis connection.
 *
 * Each write is one Lua script (EVALSHA, EVAL when Redis does not have it yet): the same
 * steps the worker's own `worker push` and `worker cancel` take (src/lua/push.lua,
 * cancel.lua), so it is atomic — the message is in the data HASH before its key is in the
 * pool, a cancel removes both, and a key of the wrong type stops the script before its
 * first write. On a Redis Cluster every key a script touches shares one slot: the layout
 * (Keys) puts them there.
 *
 * The message is the worker's envelope, `{"event":...,"payload":{...},"retry":0,"ts":<unix
 * seconds>}`, and the pool's score the due time in unix milliseconds.
 */
final class Producer
{
    /** Due times below this are not unix milliseconds (they would be read as seconds). */
    public const MIN_DUE_MS = 100000000000;
    /** Year 10000: anything later is a mistake. */
    public const MAX_DUE_MS = 253402300800000;

    private const JSON_FLAGS = JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE
        | JSON_PRESERVE_ZERO_FRACTION;

    /** @var \Redis|\RedisCluster */
    private $redis;
    /** @var Keys */
    private $keys;
    /** @var bool */
    private $checkShards;
    /** @var bool Whether the recorded shard count was read and agrees. */
    private $shardsChecked = false;
    /** @var int Replicas a write must reach (WAIT); 0: no WAIT. */
    private $waitReplicas = 0;
    /** @var int */
    private $waitTimeoutMs = 0;

    /**
     * @param \Redis|\RedisCluster $redis  a connected phpredis client, without OPT_PREFIX,
     *                                     a serializer or compression (they would change
     *                                     the key names and messages the worker reads)
     * @param array $options  'prefix' (--key-prefix, default 'mq'; '{mq}' on a Cluster),
     *                        'shards' (--shards, default 1), 'pool_key' and 'data_key'
     *                        (--pool-key, --data-key, unsharded only), 'check_shards'
     *                        (default true: refuse to write when Redis records another
     *                        shard count)
     * @throws InvalidJobException
     */
    public function __construct($redis, array $options = [])
    {
        if (PHP_INT_SIZE < 8) {
            throw new InvalidJobException('64-bit PHP is needed: due times are unix milliseconds');
        }
        if (!($redis instanceof \Redis) && !($redis instanceof \RedisCluster)) {
            throw new InvalidJobException('a phpredis \Redis or \RedisCluster connection is needed');
        }
        $known = ['prefix', 'shards', 'pool_key', 'data_key', 'check_shards'];
        foreach (array_keys($options) as $name) {
            if (!in_array($name, $known, true)) {
                throw new InvalidJobException(
                    "unknown option '$name' (known: " . implode(', ', $known) . ')'
                );
            }
        }
        $prefix = $redis->getOption(\Redis::OPT_PREFIX);
        if ($prefix !== null && $prefix !== false && $prefix !== '') {
            throw new InvalidJobException(
                "the connection has OPT_PREFIX '$prefix', which would rename the worker's keys: "
                . "give it no prefix and name the layout with the 'prefix' option"
            );
        }
        if ($redis->getOption(\Redis::OPT_SERIALIZER) !== \Redis::SERIALIZER_NONE) {
            throw new InvalidJobException(
                'the connection has a serializer (OPT_SERIALIZER), which would change the '
                . 'messages the worker reads: use a connection without one'
            );
        }
        if (defined('Redis::OPT_COMPRESSION')
            && $redis->getOption(\Redis::OPT_COMPRESSION) !== \Redis::COMPRESSION_NONE) {
            throw new InvalidJobException(
                'the connection compresses values (OPT_COMPRESSION): use a connection without it'
            );
        }
        $this->redis = $redis;
        $this->keys = new Keys(
            (string) ($options['prefix'] ?? Keys::DEFAULT_PREFIX),
            (int) ($options['shards'] ?? 1),
            $options['pool_key'] ?? null,
            $options['data_key'] ?? null
        );
        $this->checkShards = (bool) ($options['check_shards'] ?? true);
    }

    /**
     * The same producer, confirming each write with Redis's `WAIT $replicas $timeoutMs`:
     * a write counts as done only once that many replicas have it. If fewer confirm within
     * the timeout, the write still stands on the master and NotReplicatedException says so
     * (a failover before a replica has it loses it). The timeout bounds the call: keep the
     * connection's read timeout longer than it.
     *
     * @throws InvalidJobException for fewer than 1 replica or a timeout under 1 ms (WAIT
     *                             with 0 would block without end)
     */
    public function withWait(int $replicas, int $timeoutMs): self
    {
        if ($replicas < 1) {
            throw new InvalidJobException("withWait: replicas must be at least 1, not $replicas");
        }
        if ($timeoutMs < 1) {
            throw new InvalidJobException(
                "withWait: the timeout must be at least 1 ms, not $timeoutMs (0 would wait forever)"
            );
        }
        $copy = clone $this;
        $copy->waitReplicas = $replicas;
        $copy->waitTimeoutMs = $timeoutMs;
        return $copy;
    }

    public function keys(): Keys
    {
        return $this->keys;
    }

    /**
     * Schedules `$event` with `$payload`, due `$delayMs` from now. A key names the job: a
     * deterministic one (`order.timeout:SO1`) makes a second push reschedule it (one job,
     * the new message and due time) and a cancel easy; without one a key is made as the old
     * PHP producers made them (`<unix seconds>:<12 hex>`).
     *
     * @param array|object $payload a JSON object: an associative array or an object
     * @throws InvalidJobException|StoreException|ShardCountException|NotReplicatedException
     */
    public function push(string $event, $payload, int $delayMs, ?string $key = null): Pushed
    {
        if ($delayMs < 0) {
            throw new InvalidJobException("the delay must not be negative, not $delayMs ms");
        }
        return $this->schedule($event, $payload, self::nowMs() + $delayMs, $key, 'push');
    }

    /**
     * Schedules `$event` due at `$dueMs` (unix milliseconds; one in the past is due at
     * once). Otherwise as push().
     *
     * @param array|object $payload
     * @throws InvalidJobException|StoreException|ShardCountException|NotReplicatedException
     */
    public function pushAt(string $event, $payload, int $dueMs, ?string $key = null): Pushed
    {
        return $this->schedule($event, $payload, $dueMs, $key, 'push');
    }

    /**
     * Removes a scheduled job, its message and any retry record with it. True if it was
     * scheduled; false if not (never pushed, already cancelled, or already due and moved
     * to the worker, which then runs it).
     *
     * @throws InvalidJobException|StoreException|ShardCountException|NotReplicatedException
     */
    public function cancel(string $key): bool
    {
        self::checkKey($key);
        $set = $this->keys->forJob($key);
        $this->checkShardCount();
        $done = $this->script(Scripts::CANCEL, [$set->pool, $set->data, $set->jobs], [$key]) === 1;
        $this->confirm('cancel', $key, $set->pool, $done);
        return $done;
    }

    /**
     * Moves a scheduled job to a new due time (unix milliseconds), keeping its message.
     * True if it was scheduled; false if not (nothing is scheduled then: push it instead).
     *
     * @throws InvalidJobException|StoreException|ShardCountException|NotReplicatedException
     */
    public function reschedule(string $key, int $dueMs): bool
    {
        self::checkKey($key);
        self::checkDue($dueMs);
        $set = $this->keys->forJob($key);
        $this->checkShardCount();
        $done = $this->script(Scripts::RESCHEDULE, [$set->pool], [$key, $dueMs]) === 1;
        $this->confirm('reschedule', $key, $set->pool, $done);
        return $done;
    }

    /**
     * The legacy order-close pool (the worker's `--legacy-pool POOL=EVENT`): `$member`
     * (`close_order_<id>`) goes into the ZSET `$pool` with the due time in milliseconds
     * and a STRING of its own name holds the order id, which becomes the payload
     * `{"order_id": <id>}`. SET before ZADD, in one script; pushing a member again
     * reschedules it. On a Redis Cluster the member must carry the pool's hash tag
     * (`{mq}delay:order_close`, `{mq}close_order_<id>`).
     *
     * @param int|string $orderId a positive integer (digits)
     * @throws InvalidJobException|StoreException|NotReplicatedException
     */
    public function pushLegacy(string $pool, string $member, $orderId, int $dueMs): Pushed
    {
        $this->checkLegacy($pool, $member);
        if (is_int($orderId)) {
            $ok = $orderId > 0;
        } else {
            $ok = is_string($orderId) && preg_match('/^[0-9]+$/', $orderId) === 1
                && ltrim($orderId, '0') !== '';
        }
        if (!$ok) {
            throw new InvalidJobException(
                'the legacy order id must be a positive integer, not ' . var_export($orderId, true)
            );
        }
        self::checkDue($dueMs);
        $again = $this->script(Scripts::PUSH_LEGACY, [$pool, $member], [(string) $orderId, $dueMs]) === 1;
        $pushed = new Pushed($member, $dueMs, $again, 0, $pool);
        $pushed->replicas = $this->confirm('pushLegacy', $member, $pool, $pushed);
        return $pushed;
    }

    /**
     * Removes a legacy pool's member and its STRING. True if either was there.
     *
     * @throws InvalidJobException|StoreException|NotReplicatedException
     */
    public function cancelLegacy(string $pool, string $member): bool
    {
        $this->checkLegacy($pool, $member);
        $done = $this->script(Scripts::CANCEL_LEGACY, [$pool, $member], []) === 1;
        $this->confirm('cancelLegacy', $member, $pool, $done);
        return $done;
    }

    /**
     * A job key as the old PHP producers made them, `<unix seconds>:<12 hex>`.
     */
    public static function newKey(?int $nowMs = null): string
    {
        $ms = $nowMs ?? self::nowMs();
        return intdiv($ms, 1000) . ':' . bin2hex(random_bytes(6));
    }

    /**
     * The message the worker reads, as `worker push` writes it.
     *
     * @param array|object $payload
     * @throws InvalidJobException
     */
    public static function envelope(string $event, $payload, int $ts): string
    {
        if (trim($event) === '') {
            throw new InvalidJobException('the event name must not be empty');
        }
        if (is_array($payload)) {
            if ($payload === []) {
                $payload = new \stdClass();
            } elseif (array_keys($payload) === range(0, count($payload) - 1)) {
                throw new InvalidJobException(
                    'the payload must be a JSON object (an associative array or an object), not a list'
                );
            }
        } elseif (!is_object($payload)) {
            throw new InvalidJobException(
                'the payload must be a JSON object (an associative array or an object), not '
                . gettype($payload)
            );
        }
        try {
            $object = json_encode($payload, self::JSON_FLAGS | JSON_THROW_ON_ERROR);
            $name = json_encode($event, self::JSON_FLAGS | JSON_THROW_ON_ERROR);
        } catch (\JsonException $e) {
            throw new InvalidJobException('the job cannot be written as JSON: ' . $e->getMessage());
        }
        if ($object[0] !== '{') {
            // A JsonSerializable object that serializes to something else.
            throw new InvalidJobException('the payload must serialize to a JSON object, not ' . $object);
        }
        // Its fields in the order the worker writes them.
        return '{"event":' . $name . ',"payload":' . $object . ',"retry":0,"ts":' . $ts . '}';
    }

    /**
     * @param array|object $payload
     */
    private function schedule(string $event, $payload, int $dueMs, ?string $key, string $op): Pushed
    {
        self::checkDue($dueMs);
        if ($key === null) {
            $key = self::newKey();
        }
        self::checkKey($key);
        $msg = self::envelope($event, $payload, intdiv(self::nowMs(), 1000));
        $set = $this->keys->forJob($key);
        $this->checkShardCount();
        $again = $this->script(
            Scripts::PUSH,
            [$set->pool, $set->data, $set->jobs],
            [$key, $msg, $dueMs]
        ) === 1;
        $pushed = new Pushed($key, $dueMs, $again, $set->shard, $set->pool);
        $pushed->replicas = $this->confirm($op, $key, $set->pool, $pushed);
        return $pushed;
    }

    /**
     * Runs one of Scripts' scripts; returns its integer reply.
     *
     * @param string[] $keys
     * @param array $args
     */
    private function script(string $script, array $keys, array $args): int
    {
        $r = $this->redis;
        $argv = array_merge($keys, array_map('strval', $args));
        $r->clearLastError();
        $reply = $r->evalSha(sha1($script), $argv, count($keys));
        $error = $r->getLastError();
        if ($reply === false && $error !== null && strncmp($error, 'NOSCRIPT', 8) === 0) {
            $r->clearLastError();
            $reply = $r->eval($script, $argv, count($keys));
            $error = $r->getLastError();
        }
        if (is_array($reply) && ($reply[0] ?? null) === 'WRONGTYPE') {
            throw new StoreException(sprintf(
                'Redis key %s holds a %s, not a %s: nothing was written (rename or remove it)',
                $reply[1],
                $reply[2],
                $reply[3]
            ), (string) $reply[1]);
        }
        if (!is_int($reply)) {
            throw new StoreException(
                'Redis refused the write: ' . ($error ?? 'unexpected reply ' . var_export($reply, true))
            );
        }
        return $reply;
    }

    /**
     * WAIT after a write, when asked for: the confirmed count, or NotReplicatedException.
     *
     * @param Pushed|bool $result
     */
    private function confirm(string $op, string $key, string $routeKey, $result): ?int
    {
        if ($this->waitReplicas === 0) {
            return null;
        }
        $r = $this->redis;
        $r->clearLastError();
        // WAIT counts the writes of this connection: on a Cluster, the one to the master of
        // the slot just written (phpredis routes a raw command by its first argument).
        $n = $r instanceof \RedisCluster
            ? $r->rawCommand($routeKey, 'WAIT', $this->waitReplicas, $this->waitTimeoutMs)
            : $r->rawCommand('WAIT', $this->waitReplicas, $this->waitTimeoutMs);
        if (!is_int($n)) {
            throw new StoreException('Redis refused WAIT: ' . ($r->getLastError() ?? var_export($n, true)));
        }
        if ($result instanceof Pushed) {
            $result->replicas = $n;
        }
        if ($n < $this->waitReplicas) {
            throw new NotReplicatedException($op, $key, $this->waitReplicas, $n, $this->waitTimeoutMs, $result);
        }
        return $n;
    }

    /** Once per producer: Redis's recorded shard count must be this producer's. */
    private function checkShardCount(): void
    {
        if (!$this->checkShards || $this->shardsChecked) {
            return;
        }
        $name = $this->keys->shardCount();
        $recorded = $this->redis->get($name);
        if ($recorded !== false && $recorded !== null) {
            $n = (int) trim((string) $recorded);
            if ($n !== $this->keys->shards()) {
                throw new ShardCountException(sprintf(
                    'Redis records %d shards (%s) and this producer has %d: every worker and '
                    . "producer of one queue must use the same count (the 'shards' option, "
                    . "the workers' --shards); nothing was written",
                    $n,
                    $name,
                    $this->keys->shards()
                ), $n, $this->keys->shards());
            }
        }
        $this->shardsChecked = true;
    }

    private function checkLegacy(string $pool, string $member): void
    {
        if ($pool === '' || $member === '') {
            throw new InvalidJobException('the legacy pool and member must not be empty');
        }
        // One script writes both keys: on a Cluster they must share a slot, which one hash
        // tag in both names gives.
        if ($this->redis instanceof \RedisCluster
            && (Keys::hashTag($pool) === null || Keys::hashTag($pool) !== Keys::hashTag($member))) {
            throw new InvalidJobException(
                "on a Redis Cluster the legacy pool $pool and its member $member must carry "
                . 'one hash tag (e.g. {mq}delay:order_close and {mq}close_order_<id>)'
            );
        }
    }

    private static function checkKey(string $key): void
    {
        if ($key === '') {
            throw new InvalidJobException('the job key must not be empty');
        }
    }

    private static function checkDue(int $dueMs): void
    {
        if ($dueMs < self::MIN_DUE_MS || $dueMs > self::MAX_DUE_MS) {
            throw new InvalidJobException(
                "the due time $dueMs is not unix milliseconds (seconds, or a delay? "
                . 'push() takes a delay, pushAt() a time such as (int) (microtime(true) * 1000))'
            );
        }
    }

    private static function nowMs(): int
    {
        return (int) floor(microtime(true) * 1000);
    }
}
