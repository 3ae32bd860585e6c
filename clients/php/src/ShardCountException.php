<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * Redis records another shard count (`<prefix>:shards`, written by the first worker or
 * `worker push` with `--shards N`) than this producer was made with. Its jobs would land
 * in key sets no worker reads, so nothing was written. Every worker and producer of one
 * queue must use the same `shards`.
 */
class ShardCountException extends \RuntimeException implements DelayWorkerException
{
    /** @var int */
    private $recorded;
    /** @var int */
    private $configured;

    public function __construct(string $message, int $recorded, int $configured)
    {
        parent::__construct($message);
        $this->recorded = $recorded;
        $this->configured = $configured;
    }

    public function getRecorded(): int
    {
        return $this->recorded;
    }

    public function getConfigured(): int
    {
        return $this->configured;
    }
}
