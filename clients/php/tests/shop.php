<?php
// A shop's producer side, run by tests/it/php.rs against the real worker: reads a plan (a
// JSON file: the Redis port, or "cluster": the seeds of a Redis Cluster; the layout;
// "wait": [replicas, timeout ms] for withWait(); a list of steps) and does each step with
// the library, as a shop's order code would; prints one JSON line of what each step
// returned. A step with "expect_error": "SomeException" must throw that exception of the
// library, and returns {"error": "SomeException"}.
//
//   php tests/shop.php PLAN.json
//
// Steps: {"op": "push", "event", "payload", "delay_ms", "key"},
//        {"op": "push_at", "event", "payload", "due_in_ms", "key"} (due_in_ms from now, may
//        be negative), {"op": "cancel", "key"}, {"op": "reschedule", "key", "due_in_ms"},
//        {"op": "push_legacy", "pool", "member", "order_id", "due_in_ms"},
//        {"op": "cancel_legacy", "pool", "member"}.

declare(strict_types=1);

use DelayWorker\DelayWorkerException;
use DelayWorker\Producer;
use DelayWorker\Pushed;

require __DIR__ . '/../autoload.php';

if (!extension_loaded('redis')) {
    fwrite(STDERR, "the redis extension (phpredis: Debian's php-redis) is not loaded\n");
    exit(2);
}

$plan = json_decode((string) file_get_contents($argv[1]), true, 512, JSON_THROW_ON_ERROR);
if (isset($plan['cluster'])) {
    $redis = new \RedisCluster(null, $plan['cluster'], 5.0, 10.0);
} else {
    $redis = new \Redis();
    $redis->connect('127.0.0.1', (int) $plan['redis_port'], 5.0);
}
$producer = new Producer($redis, ['prefix' => $plan['prefix'], 'shards' => $plan['shards']]);
if (isset($plan['wait'])) {
    $producer = $producer->withWait($plan['wait'][0], $plan['wait'][1]);
}
$pushed = function (Pushed $p): array {
    return ['key' => $p->key, 'rescheduled' => $p->rescheduled, 'shard' => $p->shard,
        'pool' => $p->pool, 'replicas' => $p->replicas];
};

$at = function (int $inMs): int {
    return (int) (microtime(true) * 1000) + $inMs;
};
$results = [];
foreach ($plan['steps'] as $s) {
    try {
        $results[] = step($producer, $s, $at, $pushed);
        if (isset($s['expect_error'])) {
            throw new \RuntimeException('step ' . json_encode($s) . ' did not throw');
        }
    } catch (DelayWorkerException $e) {
        $short = substr(strrchr('\\' . get_class($e), '\\'), 1);
        if (($s['expect_error'] ?? null) !== $short) {
            throw $e;
        }
        $results[] = ['error' => $short];
    }
}
echo json_encode($results), "\n";

/** @return mixed what the step's call returned */
function step(Producer $producer, array $s, callable $at, callable $pushed)
{
    switch ($s['op']) {
        case 'push':
            return $pushed($producer->push($s['event'], $s['payload'], $s['delay_ms'], $s['key']));
        case 'push_at':
            return $pushed($producer->pushAt($s['event'], $s['payload'], $at($s['due_in_ms']), $s['key']));
        case 'cancel':
            return $producer->cancel($s['key']);
        case 'reschedule':
            return $producer->reschedule($s['key'], $at($s['due_in_ms']));
        case 'push_legacy':
            return $pushed($producer->pushLegacy($s['pool'], $s['member'], $s['order_id'], $at($s['due_in_ms'])));
        case 'cancel_legacy':
            return $producer->cancelLegacy($s['pool'], $s['member']);
        default:
            throw new \InvalidArgumentException('unknown step ' . json_encode($s));
    }
}
