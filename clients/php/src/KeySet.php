<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * The Redis keys of one shard's delay pool, as the worker names them (src/keys.rs).
 */
final class KeySet
{
    /** @var int The shard (0 when unsharded). */
    public $shard;
    /** @var string ZSET: member = job key, score = due time in unix milliseconds. */
    public $pool;
    /** @var string HASH: job key => message JSON. */
    public $data;
    /** @var string HASH: the worker's records of retries waiting in the pool. */
    public $jobs;

    public function __construct(int $shard, string $pool, string $data, string $jobs)
    {
        $this->shard = $shard;
        $this->pool = $pool;
        $this->data = $data;
        $this->jobs = $jobs;
    }
}
