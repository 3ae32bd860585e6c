<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * The call itself is wrong and nothing was written: an empty event or key, a payload that
 * is not a JSON object, a due time that is not unix milliseconds, a legacy order id that is
 * not a number, a layout the worker would refuse. The worker would dead-letter such a job
 * (or never find it), so it is refused here.
 */
class InvalidJobException extends \InvalidArgumentException implements DelayWorkerException
{
}
