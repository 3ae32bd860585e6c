//! Integration tests against real redis-server and PostgreSQL (see support.rs).

mod support;

mod admin;
mod chaos;
mod cli;
mod consumer;
mod faults;
mod hostile;
mod list;
mod loss;

mod migrate;
mod mover;
mod ops;
mod producer;
mod prune;
mod retention;
mod store;
