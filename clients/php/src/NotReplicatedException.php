<?php

declare(strict_types=1);

namespace DelayWorker;

/**
 * A write of a producer made with `withWait()` was done on the master, but fewer replicas
 * than asked confirmed it within the timeout (Redis's `WAIT`). The write stands: the job is
 * scheduled (or cancelled, or moved) on the master and the worker will act on it. But
 * Redis replicates after it answers, so if the master fails before a replica has the write,
 * the replica promoted in its place does not have it: a push is lost (the job never runs),
 * a cancel is undone (the job runs after all).
 *
 * What to do: push (or cancel) again — a push with the same key only reschedules it, so
 * repeating it is safe — or look at the replicas (`INFO replication` on the master). The
 * outcome of the write is `getResult()`: the Pushed of a push, the bool of a cancel or a
 * reschedule.
 */
class NotReplicatedException extends \RuntimeException implements DelayWorkerException
{
    /** @var string */
    private $operation;
    /** @var string */
    private $jobKey;
    /** @var int */
    private $wanted;
    /** @var int */
    private $confirmed;
    /** @var int */
    private $timeoutMs;
    /** @var Pushed|bool */
    private $result;

    /**
     * @param Pushed|bool $result
     */
    public function __construct(
        string $operation,
        string $jobKey,
        int $wanted,
        int $confirmed,
        int $timeoutMs,
        $result
    ) {
        parent::__construct(sprintf(
            '%s of %s is done on the Redis master, but %d of the %d replicas asked for '
            . 'confirmed it within %d ms (WAIT): it is lost if the master fails before a '
            . 'replica has it; %s again (safe: same key) or check the replicas',
            $operation,
            $jobKey,
            $confirmed,
            $wanted,
            $timeoutMs,
            $operation
        ));
        $this->operation = $operation;
        $this->jobKey = $jobKey;
        $this->wanted = $wanted;
        $this->confirmed = $confirmed;
        $this->timeoutMs = $timeoutMs;
        $this->result = $result;
    }

    /** `push`, `cancel`, `reschedule`, `pushLegacy` or `cancelLegacy`. */
    public function getOperation(): string
    {
        return $this->operation;
    }

    public function getJobKey(): string
    {
        return $this->jobKey;
    }

    /** How many replicas were asked for. */
    public function getWanted(): int
    {
        return $this->wanted;
    }

    /** How many confirmed in time. */
    public function getConfirmed(): int
    {
        return $this->confirmed;
    }

    public function getTimeoutMs(): int
    {
        return $this->timeoutMs;
    }

    /**
     * What the write did on the master.
     *
     * @return Pushed|bool
     */
    public function getResult()
    {
        return $this->result;
    }
}
