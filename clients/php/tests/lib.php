<?php
// The test runner's few helpers (no PHPUnit: nothing is fetched to run the tests).

declare(strict_types=1);

/** @var array<int, array{string, callable}> */
$GLOBALS['dw_tests'] = [];

function test(string $name, callable $body): void
{
    $GLOBALS['dw_tests'][] = [$name, $body];
}

final class Failed extends \Exception
{
}

function ok(bool $condition, string $what): void
{
    if (!$condition) {
        throw new Failed($what);
    }
}

/**
 * @param mixed $want
 * @param mixed $got
 */
function same($want, $got, string $what = ''): void
{
    if ($want !== $got) {
        throw new Failed(($what !== '' ? "$what: " : '') . 'wanted ' . var_export($want, true)
            . ', got ' . var_export($got, true));
    }
}

/** Runs $body, which must throw a $class; returns it. */
function throws(string $class, callable $body, string $what = ''): \Throwable
{
    try {
        $body();
    } catch (\Throwable $e) {
        if ($e instanceof $class) {
            return $e;
        }
        throw new Failed(($what !== '' ? "$what: " : '') . "wanted a $class, got "
            . get_class($e) . ': ' . $e->getMessage());
    }
    throw new Failed(($what !== '' ? "$what: " : '') . "wanted a $class, nothing was thrown");
}

/** An environment variable the runner cannot do without. */
function need_env(string $name): string
{
    $v = getenv($name);
    if ($v === false || $v === '') {
        fwrite(STDERR, "$name is not set: tests/it/php.rs runs these tests with a redis-server of its own\n");
        exit(2);
    }
    return $v;
}

function redis_at(int $port): \Redis
{
    $r = new \Redis();
    $r->connect('127.0.0.1', $port, 5.0);
    return $r;
}

/** @return array<string, mixed> */
function vectors(): array
{
    return json_decode((string) file_get_contents(__DIR__ . '/vectors.json'), true, 512, JSON_THROW_ON_ERROR);
}
