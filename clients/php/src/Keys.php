<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * The key layout of one queue, exactly as the worker builds it from the same flags
 * (src/keys.rs; docs/producers.md "Wire format", docs/scaling.md "Sharding"):
 *
 * - unsharded, `--key-prefix P` (default `mq`): `P:delay:pool`, `P:delay:pool:data`,
 *   `P:delay:pool:jobs`; `--pool-key` and `--data-key` name the first two themselves.
 *   On a Redis Cluster the prefix carries a hash tag (`{mq}`), so every key is in one slot.
 * - `--shards N` (N > 1): job key K belongs to shard `crc32(K) mod N`, whose keys are the
 *   default layout under the prefix `{P:i}`: `{mq:1}:delay:pool`, ... (one slot each).
 * - both: the recorded shard count `P:shards`.
 */
final class Keys
{
    public const DEFAULT_PREFIX = 'mq';
    public const MAX_SHARDS = 1024;

    /** @var string */
    private $prefix;
    /** @var int */
    private $shards;
    /** @var string|null */
    private $poolKey;
    /** @var string|null */
    private $dataKey;

    /**
     * @throws InvalidJobException for a layout the worker refuses (the same checks as its
     *                             flags: an empty prefix, shards outside 1..1024, shards
     *                             with a braced prefix or with key names of their own)
     */
    public function __construct(
        string $prefix = self::DEFAULT_PREFIX,
        int $shards = 1,
        ?string $poolKey = null,
        ?string $dataKey = null
    ) {
        if ($prefix === '') {
            throw new InvalidJobException('prefix (--key-prefix): must not be empty');
        }
        if ($shards < 1 || $shards > self::MAX_SHARDS) {
            throw new InvalidJobException(
                "shards (--shards): must be between 1 and 1024, not $shards"
            );
        }
        if ($poolKey === '' || $dataKey === '') {
            throw new InvalidJobException('pool_key and data_key must not be empty');
        }
        if ($shards > 1) {
            if ($poolKey !== null || $dataKey !== null) {
                throw new InvalidJobException(
                    'shards (--shards) names every key itself: leave out pool_key and data_key'
                );
            }
            if (strpbrk($prefix, '{}') !== false) {
                throw new InvalidJobException(
                    'shards (--shards) puts a hash tag in every name itself: give the prefix without braces'
                );
            }
        }
        $this->prefix = $prefix;
        $this->shards = $shards;
        $this->poolKey = $poolKey;
        $this->dataKey = $dataKey;
    }

    /**
     * The shard of a job key among `$shards`: `crc32(key) mod shards`, CRC-32 as zlib,
     * PHP's crc32() and the worker compute it (on 64-bit PHP, which the library needs for
     * its millisecond times, crc32() is never negative).
     */
    public static function shardOf(string $jobKey, int $shards): int
    {
        if ($shards <= 1) {
            return 0;
        }
        return crc32($jobKey) % $shards;
    }

    public function prefix(): string
    {
        return $this->prefix;
    }

    public function shards(): int
    {
        return $this->shards;
    }

    /** STRING: the shard count the workers recorded (`<prefix>:shards`). */
    public function shardCount(): string
    {
        return $this->prefix . ':shards';
    }

    /** The keys of shard `$i` (of the one set when unsharded). */
    public function shard(int $i): KeySet
    {
        if ($i < 0 || $i >= $this->shards) {
            throw new InvalidJobException("no shard $i among {$this->shards}");
        }
        if ($this->shards === 1) {
            $pool = $this->poolKey ?? $this->prefix . ':delay:pool';
            return new KeySet(0, $pool, $this->dataKey ?? $pool . ':data', $pool . ':jobs');
        }
        $pool = '{' . $this->prefix . ':' . $i . '}:delay:pool';
        return new KeySet($i, $pool, $pool . ':data', $pool . ':jobs');
    }

    /** The keys of the shard a job key belongs to. */
    public function forJob(string $jobKey): KeySet
    {
        return $this->shard(self::shardOf($jobKey, $this->shards));
    }

    /**
     * The hash tag of a key name as Redis Cluster reads it (the text between the first `{`
     * and the next `}`, when not empty), or null: keys with the same tag share a slot.
     */
    public static function hashTag(string $key): ?string
    {
        $open = strpos($key, '{');
        if ($open === false) {
            return null;
        }
        $close = strpos($key, '}', $open + 1);
        if ($close === false || $close === $open + 1) {
            return null;
        }
        return substr($key, $open + 1, $close - $open - 1);
    }
}
