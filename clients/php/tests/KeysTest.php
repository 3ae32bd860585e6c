<?php
// The shard formula and the key layout against the shared vectors (tests/it/php.rs holds
// the worker to the same file), the layout checks of the worker's flags, and the package's
// own shape (PSR-4, composer.json, no syntax newer than PHP 7.4).

declare(strict_types=1);

use DelayWorker\InvalidJobException;
use DelayWorker\Keys;

test('shard vectors: crc32(key) mod N as the worker computes it', function (): void {
    $v = vectors();
    ok(count($v['keys']) >= 10, 'the vectors hold keys');
    foreach ($v['keys'] as $k) {
        $key = (string) hex2bin($k['hex']);
        same($k['crc32'], crc32($key), "crc32 of {$k['note']}");
        foreach ($v['shards'] as $n) {
            same($k['shard'][(string) $n], Keys::shardOf($key, $n), "shard of {$k['note']} among $n");
        }
        same(0, Keys::shardOf($key, 1), "one shard: {$k['note']}");
        $keys = new Keys('mq', 3);
        same($k['shard']['3'], $keys->forJob($key)->shard, "forJob: {$k['note']}");
    }
});

test('layouts: the key names of src/keys.rs', function (): void {
    foreach (vectors()['layouts'] as $l) {
        $keys = new Keys($l['prefix'], $l['shards'], $l['pool_key'] ?? null, $l['data_key'] ?? null);
        $set = $keys->shard($l['shard']);
        $what = json_encode($l);
        same($l['shard'], $set->shard, $what);
        same($l['pool'], $set->pool, $what);
        same($l['data'], $set->data, $what);
        same($l['jobs'], $set->jobs, $what);
        same($l['shard_count'], $keys->shardCount(), $what);
    }
    // The example of docs/scaling.md (Sharding): order:1001 is in shard 1 of 3.
    same('{mq:1}:delay:pool', (new Keys('mq', 3))->forJob('order:1001')->pool);
});

test('layouts the worker refuses are refused', function (): void {
    $bad = [
        'empty prefix' => ['', 1, null, null],
        'no shards' => ['mq', 0, null, null],
        'too many shards' => ['mq', 1025, null, null],
        'braces with shards' => ['{mq}', 3, null, null],
        'a pool key with shards' => ['mq', 3, 'p', null],
        'a data key with shards' => ['mq', 2, null, 'd'],
        'an empty pool key' => ['mq', 1, '', null],
    ];
    foreach ($bad as $what => [$prefix, $shards, $pool, $data]) {
        throws(InvalidJobException::class, function () use ($prefix, $shards, $pool, $data): void {
            new Keys($prefix, $shards, $pool, $data);
        }, $what);
    }
    throws(InvalidJobException::class, function (): void {
        (new Keys('mq', 3))->shard(3);
    }, 'shard 3 of 3');
    same(1024, (new Keys('mq', 1024))->shards());
});

test('hash tags as Redis Cluster reads them', function (): void {
    same('mq', Keys::hashTag('{mq}:delay:pool'));
    same('mq:2', Keys::hashTag('{mq:2}:events'));
    same(null, Keys::hashTag('mq:delay:pool'));
    same(null, Keys::hashTag('foo{}{bar}'));
    same('{bar', Keys::hashTag('foo{{bar}}zap'));
    same(null, Keys::hashTag('{bar'));
});

test('the package: PSR-4 classes, composer.json, nothing newer than PHP 7.4', function (): void {
    $root = dirname(__DIR__);
    $composer = json_decode((string) file_get_contents("$root/composer.json"), true, 512, JSON_THROW_ON_ERROR);
    same(['DelayWorker\\' => 'src/'], $composer['autoload']['psr-4']);
    same('>=7.4', $composer['require']['php']);
    ok(isset($composer['require']['ext-redis']), 'composer.json requires ext-redis');
    // PHP 8 syntax and functions a 7.4 host would choke on.
    $php8 = ['T_MATCH', 'T_NULLSAFE_OBJECT_OPERATOR', 'T_ATTRIBUTE', 'T_READONLY', 'T_ENUM'];
    $php8fn = ['str_contains', 'str_starts_with', 'str_ends_with', 'get_debug_type', 'array_is_list', 'fdiv'];
    $files = glob("$root/src/*.php");
    ok(count($files) >= 8, 'src/ holds the classes');
    foreach ($files as $file) {
        $name = basename($file, '.php');
        $class = "DelayWorker\\$name";
        ok(class_exists($class) || interface_exists($class), "the autoloader loads $class from $file");
        foreach (token_get_all((string) file_get_contents($file)) as $t) {
            if (!is_array($t)) {
                continue;
            }
            foreach ($php8 as $kind) {
                ok(!defined($kind) || $t[0] !== constant($kind), "$name.php uses $kind (PHP 8)");
            }
            ok($t[0] !== T_STRING || !in_array(strtolower($t[1]), $php8fn, true), "$name.php calls {$t[1]} (PHP 8)");
            ok($t[0] !== T_STRING || strtolower($t[1]) !== 'mixed', "$name.php uses the type mixed (PHP 8)");
        }
    }
});
