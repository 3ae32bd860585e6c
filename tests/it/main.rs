//! Integration tests against real redis-server and PostgreSQL (see support.rs).

mod support;

mod admin;
mod bench_cluster;
mod chaos;
mod cli;
mod clock;
mod cluster;
mod consumer;
mod docs;
mod faults;
mod handlers_check;
mod help;
mod hostile;
mod identity;
mod legacy_stall;
mod list;
mod list_dead;
mod lock_holder;
mod loss;
mod metrics_server;
mod operator;

mod migrate;
mod monitoring;
mod mover;
mod ops;
mod php;
mod privilege;
mod producer;
mod prune;
#[path = "../docs/quick_start.rs"]
mod quick_start;
mod release;
mod reload;
mod retention;
mod secrets;
mod sentinel;
mod sets;
mod shopdb;
mod status_page;
mod store;
mod tls;
mod topology;
mod trace;
mod unit_env;
mod url_hints;
