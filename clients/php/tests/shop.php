<?php
// A shop's producer side, run by tests/it/php.rs against the real worker: reads a plan (a
// JSON file: the Redis port, the layout and a list of steps) and does each step with the
// library, as a shop's order code would; prints one JSON line of what each step returned.
//
//   php tests/shop.php PLAN.json
//
// Steps: {"op": "push", "event", "payload", "delay_ms", "key"},
//        {"op": "push_at", "event", "payload", "due_in_ms", "key"} (due_in_ms from now, may
//        be negative), {"op": "cancel", "key"}, {"op": "reschedule", "key", "due_in_ms"},
//        {"op": "push_legacy", "pool", "member", "order_id", "due_in_ms"},
//        {"op": "cancel_legacy", "pool", "member"}.

declare(strict_types=1);

require __DIR__ . '/../autoload.php';

if (!extension_loaded('redis')) {
    fwrite(STDERR, "the redis extension (phpredis: Debian's php-redis) is not loaded\n");
    exit(2);
}

use DelayWorker\Producer;

$plan = json_decode((string) file_get_contents($argv[1]), true, 512, JSON_THROW_ON_ERROR);
$redis = new \Redis();
$redis->connect('127.0.0.1', (int) $plan['redis_port'], 5.0);
$producer = new Producer($redis, ['prefix' => $plan['prefix'], 'shards' => $plan['shards']]);

$at = function (int $inMs): int {
    return (int) (microtime(true) * 1000) + $inMs;
};
$results = [];
foreach ($plan['steps'] as $s) {
    switch ($s['op']) {
        case 'push':
            $p = $producer->push($s['event'], $s['payload'], $s['delay_ms'], $s['key']);
            $results[] = ['key' => $p->key, 'rescheduled' => $p->rescheduled, 'shard' => $p->shard, 'pool' => $p->pool];
            break;
        case 'push_at':
            $p = $producer->pushAt($s['event'], $s['payload'], $at($s['due_in_ms']), $s['key']);
            $results[] = ['key' => $p->key, 'rescheduled' => $p->rescheduled, 'shard' => $p->shard, 'pool' => $p->pool];
            break;
        case 'cancel':
            $results[] = $producer->cancel($s['key']);
            break;
        case 'reschedule':
            $results[] = $producer->reschedule($s['key'], $at($s['due_in_ms']));
            break;
        case 'push_legacy':
            $p = $producer->pushLegacy($s['pool'], $s['member'], $s['order_id'], $at($s['due_in_ms']));
            $results[] = ['key' => $p->key, 'rescheduled' => $p->rescheduled, 'shard' => $p->shard, 'pool' => $p->pool];
            break;
        case 'cancel_legacy':
            $results[] = $producer->cancelLegacy($s['pool'], $s['member']);
            break;
        default:
            throw new \InvalidArgumentException('unknown step ' . json_encode($s));
    }
}
echo json_encode($results), "\n";
