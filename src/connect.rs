//! Opening Redis, for every user of it: the daemon's start, the operator's commands,
//! `push` and `cancel`, the benchmark. Each checks that the server answers and that the
//! shard count it records agrees with `--shards`; a failure is one readable line
//! ([`ConnectError`]) naming the URL without its password.

use crate::config::Config;
use crate::store;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The Redis URL or its TLS files cannot work (bad input).
    #[error(transparent)]
    BadRedis(#[from] crate::tls::SetupError),
    #[error("cannot reach Redis at {url}: {reason}")]
    RedisUnreachable { url: String, reason: String },
    /// The keys in Redis are laid out for another `--shards`.
    #[error("{0}")]
    Layout(String),
}

/// Opens the Redis client (with its TLS files for a `rediss://` URL) and checks that the
/// server answers.
pub fn redis_client(config: &Config) -> Result<crate::store::Redis, ConnectError> {
    let url = &config.redis_url;
    let client = crate::tls::redis_client(url, &config.redis_tls)?;
    let unreachable = |e: redis::RedisError| ConnectError::RedisUnreachable {
        url: config.derived.redis_shown.clone(),
        reason: unreachable_reason(&e, url),
    };
    let mut con = store::connect(&client).map_err(unreachable)?;
    // A read-only probe: the first thing a new connection is asked.
    redis::cmd("PING")
        .query::<String>(&mut con)
        .map_err(unreachable)?;
    Ok(client)
}

/// Checks `--shards` against the count recorded in Redis; with `claim` (a worker's start,
/// a push) records it when nothing is recorded yet.
pub fn check_shards(
    config: &Config,
    con: &mut dyn redis::ConnectionLike,
    claim: bool,
) -> Result<(), ConnectError> {
    let n = config.shards;
    let key = &config.keys.shard_count;
    match store::check_shards(con, &config.keys, n, claim) {
        Ok(store::ShardLayout::Agrees) => Ok(()),
        Ok(store::ShardLayout::Differs { recorded }) => Err(ConnectError::Layout(format!(
            "--shards {n}: Redis records {recorded} shards ({key}); every worker and producer \
             of one queue must use the same count. To change it: stop the producers, let the \
             workers drain every shard (`worker stats --shards {recorded}` shows nothing \
             waiting or pending), stop them, DEL {key}, and start everything with the new count"
        ))),
        Ok(store::ShardLayout::UnshardedJobs { pool, jobs }) => Err(ConnectError::Layout(format!(
            "--shards {n}: the unsharded {pool} still holds {jobs} jobs (waiting, or read and \
             not acknowledged); let workers without --shards drain it first, then start with \
             --shards {n}"
        ))),
        Err(e) => Err(ConnectError::RedisUnreachable {
            url: config.derived.redis_shown.clone(),
            reason: e.to_string(),
        }),
    }
}

/// One checked connection, for the admin commands, `push` and `cancel`.
pub fn redis_connection(config: &Config) -> Result<crate::store::Con, ConnectError> {
    let client = redis_client(config)?;
    let mut con = store::connect(&client).map_err(|e| ConnectError::RedisUnreachable {
        url: config.derived.redis_shown.clone(),
        reason: unreachable_reason(&e, &config.redis_url),
    })?;
    check_shards(config, &mut con, false)?;
    Ok(con)
}

/// Why Redis could not be reached, in words: a server that accepts the connection but
/// never answers reads as the socket's "Resource temporarily unavailable" otherwise, and
/// a TLS failure is said in plain words.
pub fn unreachable_reason(e: &redis::RedisError, url: &str) -> String {
    let reason = unreachable_words(e, url);
    // A password with an unencoded `@`, `/` or `#` moves the host: the lookup fails, or
    // the password is wrong; the fix is the URL's.
    match crate::conninfo::percent_encoding_hint(url) {
        Some(hint) => format!("{reason}; {hint}"),
        None => reason,
    }
}

fn unreachable_words(e: &redis::RedisError, url: &str) -> String {
    let scheme = url.split("://").next().unwrap_or("");
    let tls_url = scheme.starts_with("rediss") || scheme.starts_with("valkeys");
    if let Some(tls) = crate::tls::describe(e, "--redis-ca-file") {
        tls
    } else if e.is_timeout() {
        let hint = if tls_url {
            "; if this port does not speak TLS, use redis://"
        } else {
            ""
        };
        format!("no answer within the timeout ({e}){hint}")
    } else if !tls_url && e.is_connection_dropped() {
        format!("{e} (if this port speaks TLS, use rediss://)")
    } else {
        e.to_string()
    }
}
