<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * Redis refused a write: a key of the wrong type (`getKey()` names it; nothing was
 * written, the type is checked before the first write), a script error, a command an ACL
 * user may not run. Connection failures are phpredis's \RedisException.
 */
class StoreException extends \RuntimeException implements DelayWorkerException
{
    /** @var string|null */
    private $key;

    public function __construct(string $message, ?string $key = null)
    {
        parent::__construct($message);
        $this->key = $key;
    }

    /** The key of the wrong type, when that was the reason. */
    public function getKey(): ?string
    {
        return $this->key;
    }
}
