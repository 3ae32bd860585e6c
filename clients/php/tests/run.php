<?php
// The library's tests: plain PHP scripts with checks, run against a redis-server of the
// caller's (tests/it/php.rs starts one, and a second with a replica):
//
//   DW_TEST_REDIS_PORT=6379 DW_TEST_REPLICATED_PORT=6380 php tests/run.php
//
// Quiet when every test passes but for the closing count; a failure names the test and
// exits 1. A missing phpredis (Debian's php-redis) fails, it does not skip.

declare(strict_types=1);

require __DIR__ . '/../autoload.php';
require __DIR__ . '/lib.php';

if (!extension_loaded('redis')) {
    fwrite(STDERR, "the redis extension (phpredis: Debian's php-redis) is not loaded\n");
    exit(2);
}
if (PHP_INT_SIZE < 8) {
    fwrite(STDERR, "these tests run on 64-bit PHP\n");
    exit(2);
}

require __DIR__ . '/KeysTest.php';
require __DIR__ . '/ProducerTest.php';

$passed = 0;
$failed = 0;
foreach ($GLOBALS['dw_tests'] as [$name, $body]) {
    try {
        $body();
        $passed++;
    } catch (\Throwable $e) {
        $failed++;
        $where = $e instanceof Failed ? '' : ' (' . get_class($e) . ' at ' . $e->getFile() . ':' . $e->getLine() . ')';
        fwrite(STDERR, "FAILED $name: " . $e->getMessage() . "$where\n");
    }
}
echo "php: $passed passed, $failed failed\n";
exit($failed === 0 ? 0 : 1);
