<?php
// For a project without Composer: `require '/path/to/clients/php/autoload.php';` loads the
// classes of src/ as Composer's PSR-4 autoloader would (composer.json: DelayWorker\ => src/).
spl_autoload_register(static function (string $class): void {
    $prefix = 'DelayWorker\\';
    if (strncmp($class, $prefix, strlen($prefix)) !== 0) {
        return;
    }
    $file = __DIR__ . '/src/' . str_replace('\\', '/', substr($class, strlen($prefix))) . '.php';
    if (is_file($file)) {
        require $file;
    }
});
