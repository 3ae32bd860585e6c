<?php
// The producer against a real redis-server: what each call writes, byte for byte where the
// worker reads it, what it refuses and leaves unwritten, and the durable push with and
// without a replica. Each test has a key prefix of its own on the one server.

declare(strict_types=1);

use DelayWorker\InvalidJobException;
use DelayWorker\NotReplicatedException;
use DelayWorker\Producer;
use DelayWorker\Pushed;
use DelayWorker\ShardCountException;
use DelayWorker\StoreException;

$port = (int) need_env('DW_TEST_REDIS_PORT');
$replicated = (int) need_env('DW_TEST_REPLICATED_PORT');

test('push writes the envelope into the data hash, then the ms score', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p1']);
    $before = time();
    $pushed = $p->push('order.timeout', ['order_no' => 'SO1', 'note' => 'a/b 订单'], 900000, 'order.timeout:SO1');
    $after = time();
    same('order.timeout:SO1', $pushed->key);
    same(false, $pushed->rescheduled);
    same(0, $pushed->shard);
    same('p1:delay:pool', $pushed->pool);
    same(null, $pushed->replicas);
    ok($pushed->dueMs >= $before * 1000 + 900000 && $pushed->dueMs <= ($after + 1) * 1000 + 900000, 'due in 15 minutes');
    same((float) $pushed->dueMs, $r->zScore('p1:delay:pool', 'order.timeout:SO1'), 'the score is the due time in ms');
    $msg = $r->hGet('p1:delay:pool:data', 'order.timeout:SO1');
    $ts = json_decode($msg, true)['ts'];
    ok($ts >= $before && $ts <= $after, "ts is the unix second of the push: $ts");
    // As `worker push` writes it: these fields in this order, slashes and UTF-8 as they are.
    same('{"event":"order.timeout","payload":{"order_no":"SO1","note":"a/b 订单"},"retry":0,"ts":' . $ts . '}', $msg);
    same([], $r->keys('p1:delay:pool:jobs'), 'push writes no retry record');
});

test('a second push of a key reschedules it: one job, the new message and due time', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p2']);
    $p->push('order.timeout', ['order_no' => 'SO2'], 900000, 'k');
    $due = (int) (microtime(true) * 1000) + 5000;
    $again = $p->pushAt('order.timeout', ['order_no' => 'SO2', 'v' => 2], $due, 'k');
    same(true, $again->rescheduled);
    same($due, $again->dueMs);
    same(1, $r->zCard('p2:delay:pool'));
    same((float) $due, $r->zScore('p2:delay:pool', 'k'));
    same(['order_no' => 'SO2', 'v' => 2], json_decode($r->hGet('p2:delay:pool:data', 'k'), true)['payload']);
    // An empty payload is an empty object, not a list.
    $p->push('coupon.expire', [], 0, 'e');
    same('{}', json_encode(json_decode($r->hGet('p2:delay:pool:data', 'e'))->payload));
    $p->push('coupon.expire', (object) ['coupon_id' => 7], 0, 'o');
    same(['coupon_id' => 7], json_decode($r->hGet('p2:delay:pool:data', 'o'), true)['payload']);
});

test('generated keys have the old producer shape and do not repeat', function () use ($port): void {
    $p = new Producer(redis_at($port), ['prefix' => 'p3']);
    $seen = [];
    for ($i = 0; $i < 100; $i++) {
        $key = $p->push('coupon.expire', ['coupon_id' => $i], 60000)->key;
        ok(preg_match('/^[0-9]{10}:[0-9a-f]{12}$/', $key) === 1, "key shape: $key");
        $seen[$key] = true;
    }
    same(100, count($seen));
    same('1768764300:', substr(Producer::newKey(1768764300123), 0, 11));
});

test('cancel removes score, data and retry record together, and says whether it was there', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p4']);
    $p->push('order.timeout', ['order_no' => 'SO4'], 900000, 'order.timeout:SO4');
    // A retry waiting in the pool has a record of the worker's.
    $r->hSet('p4:delay:pool:jobs', 'order.timeout:SO4', '1-0 abc');
    same(true, $p->cancel('order.timeout:SO4'));
    same(false, $p->cancel('order.timeout:SO4'));
    same(0, $r->zCard('p4:delay:pool'));
    same(0, $r->hLen('p4:delay:pool:data'));
    same(0, $r->hLen('p4:delay:pool:jobs'));
});

test('reschedule moves a scheduled job and keeps its message; an absent one stays absent', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p5']);
    $p->push('order.timeout', ['order_no' => 'SO5'], 900000, 'a');
    $msg = $r->hGet('p5:delay:pool:data', 'a');
    $due = (int) (microtime(true) * 1000) + 1000;
    same(true, $p->reschedule('a', $due));
    same((float) $due, $r->zScore('p5:delay:pool', 'a'));
    same($msg, $r->hGet('p5:delay:pool:data', 'a'));
    same(false, $p->reschedule('b', $due));
    same(1, $r->zCard('p5:delay:pool'));
    same(false, $r->hExists('p5:delay:pool:data', 'b'));
});

test('the legacy pool: SET member id, ZADD ms score; cancel takes both', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r);
    $due = (int) (microtime(true) * 1000) + 60000;
    $pushed = $p->pushLegacy('p6:delay:order_close', 'p6:close_order_42', 42, $due);
    same(['p6:close_order_42', false, 'p6:delay:order_close'], [$pushed->key, $pushed->rescheduled, $pushed->pool]);
    same('42', $r->get('p6:close_order_42'));
    same((float) $due, $r->zScore('p6:delay:order_close', 'p6:close_order_42'));
    same(true, $p->pushLegacy('p6:delay:order_close', 'p6:close_order_42', '0042', $due + 1)->rescheduled);
    same('0042', $r->get('p6:close_order_42'));
    same(true, $p->cancelLegacy('p6:delay:order_close', 'p6:close_order_42'));
    same(false, $p->cancelLegacy('p6:delay:order_close', 'p6:close_order_42'));
    same(0, $r->zCard('p6:delay:order_close'));
    same(0, $r->exists('p6:close_order_42'));
    foreach (['x', '', '-1', '1.5', 0, -3, 1.5, null] as $bad) {
        throws(InvalidJobException::class, function () use ($p, $bad, $due): void {
            $p->pushLegacy('p6:delay:order_close', 'p6:close_order_1', $bad, $due);
        }, 'order id ' . var_export($bad, true));
    }
    same(0, $r->exists('p6:close_order_1'));
    // A member key of another type is not the pool's: refused, left alone.
    $r->hSet('p6:close_order_9', 'f', 'v');
    $e = throws(StoreException::class, function () use ($p): void {
        $p->cancelLegacy('p6:delay:order_close', 'p6:close_order_9');
    });
    same('p6:close_order_9', $e->getKey());
    same(1, $r->exists('p6:close_order_9'));
});

test('jobs the worker would dead-letter or never find are refused, nothing written', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p7']);
    $now = (int) (microtime(true) * 1000);
    $cases = [
        'an empty event' => fn () => $p->push(' ', ['a' => 1], 0, 'k'),
        'a list payload' => fn () => $p->push('e', [1, 2], 0, 'k'),
        'a scalar payload' => fn () => $p->push('e', 'SO1', 0, 'k'),
        'a payload serializing to a list' => fn () => $p->push('e', new class () implements \JsonSerializable {
            public function jsonSerialize(): array
            {
                return [1];
            }
        }, 0, 'k'),
        'invalid UTF-8' => fn () => $p->push('e', ['order_no' => "\xff"], 0, 'k'),
        'an empty key' => fn () => $p->push('e', ['a' => 1], 0, ''),
        'a negative delay' => fn () => $p->push('e', ['a' => 1], -1, 'k'),
        'seconds for a due time' => fn () => $p->pushAt('e', ['a' => 1], time() + 900, 'k'),
        'a due time past year 10000' => fn () => $p->pushAt('e', ['a' => 1], $now * 1000, 'k'),
        'a reschedule to seconds' => fn () => $p->reschedule('k', time()),
        'an empty cancel key' => fn () => $p->cancel(''),
    ];
    foreach ($cases as $what => $call) {
        throws(InvalidJobException::class, $call, $what);
    }
    same([], $r->keys('p7:*'));
    throws(InvalidJobException::class, fn () => new Producer($r, ['prefx' => 'mq']), 'an unknown option');
    throws(InvalidJobException::class, fn () => new Producer($r, ['shards' => 3, 'prefix' => '{mq}']), 'braces with shards');
    throws(InvalidJobException::class, fn () => new Producer(new \stdClass()), 'not phpredis');
});

test('a key of the wrong type stops the write before anything is written, naming the key', function () use ($port): void {
    $r = redis_at($port);
    $r->set('p8:delay:pool', 'x');
    $e = throws(StoreException::class, fn () => (new Producer($r, ['prefix' => 'p8']))->push('e', ['a' => 1], 0, 'k'));
    same('p8:delay:pool', $e->getKey());
    ok(strpos($e->getMessage(), 'holds a string, not a zset') !== false, $e->getMessage());
    same(0, $r->exists('p8:delay:pool:data'));
    $r->sAdd('p8b:delay:pool:data', 'x');
    $e = throws(StoreException::class, fn () => (new Producer($r, ['prefix' => 'p8b']))->push('e', ['a' => 1], 0, 'k'));
    same('p8b:delay:pool:data', $e->getKey());
    same(0, $r->exists('p8b:delay:pool'));
});

test('shards: each key goes to the pool of crc32(key) mod N, and cancel finds it there', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 's9', 'shards' => 3]);
    $pushed = $p->push('order.timeout', ['order_no' => 'SO1001'], 900000, 'order:1001');
    same(1, $pushed->shard);
    same('{s9:1}:delay:pool', $pushed->pool);
    ok($r->zScore('{s9:1}:delay:pool', 'order:1001') !== false, 'in shard 1');
    ok($r->hExists('{s9:1}:delay:pool:data', 'order:1001'), 'its data in shard 1');
    same(0, $r->zCard('{s9:0}:delay:pool') + $r->zCard('{s9:2}:delay:pool'));
    same(true, $p->cancel('order:1001'));
    same(0, $r->zCard('{s9:1}:delay:pool'));
});

test('a producer whose shard count Redis does not record refuses to write', function () use ($port): void {
    $r = redis_at($port);
    $r->set('s10:shards', '3');
    $e = throws(ShardCountException::class, fn () => (new Producer($r, ['prefix' => 's10']))->push('e', ['a' => 1], 0, 'k'));
    same([3, 1], [$e->getRecorded(), $e->getConfigured()]);
    ok(strpos($e->getMessage(), 's10:shards') !== false, $e->getMessage());
    same(0, $r->exists('s10:delay:pool'));
    throws(ShardCountException::class, fn () => (new Producer($r, ['prefix' => 's10', 'shards' => 2]))->cancel('k'));
    (new Producer($r, ['prefix' => 's10', 'shards' => 3]))->push('e', ['a' => 1], 0, 'k');
    (new Producer($r, ['prefix' => 's10', 'check_shards' => false]))->push('e', ['a' => 1], 0, 'k');
    same(1, $r->zCard('s10:delay:pool'));
});

test('a connection that would rename keys or rewrite messages is refused', function () use ($port): void {
    $r = redis_at($port);
    $r->setOption(\Redis::OPT_PREFIX, 'app:');
    throws(InvalidJobException::class, fn () => new Producer($r), 'OPT_PREFIX');
    $r = redis_at($port);
    $r->setOption(\Redis::OPT_SERIALIZER, \Redis::SERIALIZER_PHP);
    throws(InvalidJobException::class, fn () => new Producer($r), 'a serializer');
});

test('scripts are loaded again after SCRIPT FLUSH (EVALSHA, then EVAL)', function () use ($port): void {
    $r = redis_at($port);
    $p = new Producer($r, ['prefix' => 'p12']);
    $p->push('e', ['a' => 1], 0, 'k1');
    $r->script('flush');
    $p->push('e', ['a' => 1], 0, 'k2');
    same(true, $p->cancel('k1'));
    same(1, $r->zCard('p12:delay:pool'));
});

test('a durable push without a replica: written on the master, NotReplicatedException after the timeout', function () use ($port): void {
    $r = redis_at($port);
    $p = (new Producer($r, ['prefix' => 'p13']))->withWait(1, 50);
    $start = microtime(true);
    $e = throws(NotReplicatedException::class, fn () => $p->push('order.timeout', ['order_no' => 'SO13'], 900000, 'order.timeout:SO13'));
    $took = microtime(true) - $start;
    ok($took >= 0.045 && $took < 2.0, "waited for the timeout: {$took}s");
    same(['push', 'order.timeout:SO13', 1, 0, 50], [$e->getOperation(), $e->getJobKey(), $e->getWanted(), $e->getConfirmed(), $e->getTimeoutMs()]);
    ok(strpos($e->getMessage(), 'lost if the master fails') !== false, $e->getMessage());
    $pushed = $e->getResult();
    ok($pushed instanceof Pushed, 'the result is the push');
    same(0, $pushed->replicas);
    // The write stands on the master.
    same((float) $pushed->dueMs, $r->zScore('p13:delay:pool', 'order.timeout:SO13'));
    $e = throws(NotReplicatedException::class, fn () => $p->cancel('order.timeout:SO13'));
    same(['cancel', true], [$e->getOperation(), $e->getResult()]);
    same(0, $r->zCard('p13:delay:pool'));
    throws(InvalidJobException::class, fn () => $p->withWait(0, 100), 'no replicas');
    throws(InvalidJobException::class, fn () => $p->withWait(1, 0), 'WAIT without end');
});

test('a durable push with a replica: confirmed by it', function () use ($replicated): void {
    $r = redis_at($replicated);
    $p = (new Producer($r, ['prefix' => 'p14']))->withWait(1, 5000);
    $pushed = $p->push('order.timeout', ['order_no' => 'SO14'], 900000, 'order.timeout:SO14');
    same(1, $pushed->replicas);
    same(true, $p->reschedule('order.timeout:SO14', $pushed->dueMs + 1));
    same(true, $p->cancel('order.timeout:SO14'));
    // Without withWait() nothing waits.
    same(null, (new Producer($r, ['prefix' => 'p14']))->push('e', ['a' => 1], 0, 'k')->replicas);
});
