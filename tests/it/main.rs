//! Integration tests against real redis-server and PostgreSQL (see support.rs).

mod support;

mod cli;
mod consumer;
mod faults;
mod list;

mod migrate;
mod mover;
mod producer;
