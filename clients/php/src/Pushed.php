<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * What a push did.
 */
final class Pushed
{
    /** @var string The job key (generated when none was given). */
    public $key;
    /** @var int The due time, unix milliseconds (the score written). */
    public $dueMs;
    /** @var bool The key was already scheduled and now has this due time and message. */
    public $rescheduled;
    /** @var int The shard it went to (0 when unsharded). */
    public $shard;
    /** @var string The pool (ZSET) it went into. */
    public $pool;
    /** @var int|null Replicas that confirmed it (WAIT), or null without withWait(). */
    public $replicas;

    public function __construct(
        string $key,
        int $dueMs,
        bool $rescheduled,
        int $shard,
        string $pool,
        ?int $replicas = null
    ) {
        $this->key = $key;
        $this->dueMs = $dueMs;
        $this->rescheduled = $rescheduled;
        $this->shard = $shard;
        $this->pool = $pool;
        $this->replicas = $replicas;
    }
}
