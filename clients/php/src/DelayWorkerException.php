<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * Every exception this library throws implements it: `catch (DelayWorkerException $e)`
 * takes them all. phpredis's own \RedisException (a lost connection, a read timeout)
 * passes through as it is.
 */
interface DelayWorkerException extends \Throwable
{
}
