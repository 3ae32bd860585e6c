//! Where the worker's Redis is: one server, a Redis Cluster, or a master found through
//! Sentinel. [`Redis`] makes connections; [`Con`] is one, and every store function takes it
//! as `&mut dyn ConnectionLike`, so the scripts run the same way on each.
//!
//! - `redis://` / `rediss://`: one server.
//! - `redis+cluster://host:port[,host:port...]` (`rediss+cluster://` with TLS): seed nodes of
//!   a Redis Cluster; redis-rs's synchronous cluster client routes each command and script
//!   by its first key and follows `MOVED`/`ASK` and failovers. Every script declares every
//!   key it touches, and all of them share one hash slot (see `keys.rs`).
//! - `redis+sentinel://host:port[,host:port...]/<master-name>[/<db>]`
//!   (`rediss+sentinel://` with TLS): the Sentinels are asked for the master at each
//!   connect, and the master is checked with `ROLE`. After a failover the old connection
//!   breaks or answers `READONLY`; both count as a lost connection, so the next connect
//!   finds the promoted replica. An old master that is still up keeps answering as a
//!   master for a while after the Sentinels promoted its replica (they demote it seconds
//!   later, or never while it is cut off from them): so the Sentinels are asked again
//!   once a second which master they name (one look-up shared by every connection), and
//!   every connection to another counts as lost at its next command, all of them together.
//!
//! A user name and password in the URL are for the Redis servers (not the Sentinels).

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::{ConnectionAddr, ConnectionLike, IntoConnectionInfo, RedisResult, TlsCertificates};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a connect may take before it counts as "unreachable".
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The kind of Redis deployment a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    Single,
    Cluster,
    Sentinel,
}

impl Topology {
    /// The topology of `url` by its scheme.
    pub fn of(url: &str) -> Topology {
        let scheme = url.split("://").next().unwrap_or("");
        if scheme.ends_with("+cluster") {
            Topology::Cluster
        } else if scheme.ends_with("+sentinel") {
            Topology::Sentinel
        } else {
            Topology::Single
        }
    }
}

/// Makes connections to the Redis of `--redis-url`. Cheap to clone; shared by every thread.
#[derive(Clone)]
pub enum Redis {
    Single(redis::Client),
    Cluster(ClusterClient),
    Sentinel(Arc<SentinelLink>),
}

/// How long one look-up of the master the Sentinels name serves every connection.
const MASTER_CHECK: Duration = Duration::from_secs(1);

/// A master's host and port.
type HostPort = (String, u16);

/// How long one Sentinel, or the master it names, may take to answer a look-up.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

/// The Sentinels, how to reach the master they name, and the master they named at the last
/// look-up (when). The look-up is ours, not redis-rs's Sentinel client, so that every step
/// has a deadline: a Sentinel that accepts a connection and never answers costs
/// [`LOOKUP_TIMEOUT`], then the next one is asked.
pub struct SentinelLink {
    sentinels: Vec<redis::Client>,
    name: String,
    scheme: &'static str,
    /// `user:password@` of the servers (or empty), as written in the URL.
    auth: String,
    db: i64,
    certs: Option<TlsCertificates>,
    /// The index of the Sentinel that answered last.
    answered: std::sync::atomic::AtomicUsize,
    named: Mutex<(Option<Instant>, Option<HostPort>)>,
}

impl SentinelLink {
    /// A client for the master the Sentinels name, which says `ROLE` master: each Sentinel
    /// in turn until one names a master that says so.
    /// The Sentinel that answered last is asked first.
    fn master(&self) -> RedisResult<redis::Client> {
        use std::sync::atomic::Ordering;
        let mut last = None;
        let first = self.answered.load(Ordering::Relaxed);
        let n = self.sentinels.len();
        for i in (0..n).map(|k| (first + k) % n) {
            match self.master_from(&self.sentinels[i]) {
                Ok(c) => {
                    self.answered.store(i, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::Client, "no Sentinel given"))
        }))
    }

    fn master_from(&self, sentinel: &redis::Client) -> RedisResult<redis::Client> {
        let mut s = sentinel.get_connection_with_timeout(CONNECT_TIMEOUT)?;
        s.set_read_timeout(Some(LOOKUP_TIMEOUT))?;
        s.set_write_timeout(Some(LOOKUP_TIMEOUT))?;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.name)
            .query(&mut s)?;
        let Some((host, port)) = addr else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "the Sentinel knows no master of that name",
                self.name.clone(),
            )));
        };
        let host_in_url = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let url = format!(
            "{}://{}{host_in_url}:{port}/{}",
            self.scheme, self.auth, self.db
        );
        let client = match &self.certs {
            Some(c) => redis::Client::build_with_tls(url, c.clone())?,
            None => redis::Client::open(url)?,
        };
        let mut m = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
        m.set_read_timeout(Some(LOOKUP_TIMEOUT))?;
        m.set_write_timeout(Some(LOOKUP_TIMEOUT))?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut m)?;
        let is_master = matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master")
            || matches!(role.first(), Some(redis::Value::SimpleString(r)) if r == "master");
        if !is_master {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "the Sentinel names a server that is not a master (a failover under way)",
                format!("{host}:{port}"),
            )));
        }
        Ok(client)
    }

    /// The master the Sentinels name now, looked up at most once a [`MASTER_CHECK`] for
    /// all connections; `None` when no Sentinel names one that says it is the master.
    fn named_master(&self) -> Option<HostPort> {
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        if named.0.is_none_or(|at| at.elapsed() >= MASTER_CHECK) {
            let master = self
                .master()
                .ok()
                .and_then(|c| host_port(c.get_connection_info().addr()));
            *named = (Some(Instant::now()), master);
        }
        named.1.clone()
    }
}

fn host_port(addr: &ConnectionAddr) -> Option<HostPort> {
    match addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            Some((host.clone(), *port))
        }
        _ => None,
    }
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Redis::Single(_) => "Redis::Single",
            Redis::Cluster(_) => "Redis::Cluster",
            Redis::Sentinel(_) => "Redis::Sentinel",
        })
    }
}

impl From<redis::Client> for Redis {
    fn from(client: redis::Client) -> Redis {
        Redis::Single(client)
    }
}

/// Why a URL cannot name a Redis: the part that is wrong, in words.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct UrlError(pub String);

/// `user:password@` (or empty), the host list and the path of a `+cluster`/`+sentinel` URL.
struct Parts<'a> {
    tls: bool,
    auth: &'a str,
    hosts: Vec<&'a str>,
    path: &'a str,
    query: &'a str,
}

fn parts(url: &str) -> Result<Parts<'_>, UrlError> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| UrlError("no scheme".into()))?;
    let tls = scheme.starts_with("rediss") || scheme.starts_with("valkeys");
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let (auth, hosts) = match authority.rfind('@') {
        Some(i) => (&authority[..=i], &authority[i + 1..]),
        None => ("", authority),
    };
    let hosts: Vec<&str> = hosts.split(',').filter(|h| !h.is_empty()).collect();
    if hosts.is_empty() {
        return Err(UrlError("names no host".into()));
    }
    Ok(Parts {
        tls,
        auth,
        hosts,
        path,
        query,
    })
}

impl Redis {
    /// The client for `url`, with `certs` for TLS when given. Parses only: nothing is
    /// connected yet.
    pub fn open(url: &str, certs: Option<TlsCertificates>) -> Result<Redis, UrlError> {
        match Topology::of(url) {
            Topology::Single => {
                let client = match certs {
                    Some(c) => redis::Client::build_with_tls(url, c),
                    None => redis::Client::open(url),
                };
                client
                    .map(Redis::Single)
                    .map_err(|e| UrlError(e.detail().unwrap_or("cannot parse it").to_string()))
            }
            Topology::Cluster => Self::cluster(url, certs),
            Topology::Sentinel => Self::sentinel(url, certs),
        }
    }

    fn cluster(url: &str, certs: Option<TlsCertificates>) -> Result<Redis, UrlError> {
        let p = parts(url)?;
        let scheme = if p.tls { "rediss" } else { "redis" };
        if !(p.path.is_empty() || p.path == "/" || p.path == "/0") {
            return Err(UrlError(
                "a Redis Cluster has only database 0; drop the path".into(),
            ));
        }
        let nodes: Vec<String> = p
            .hosts
            .iter()
            .map(|h| format!("{scheme}://{}{h}/", p.auth))
            .collect();
        for n in &nodes {
            n.as_str()
                .into_connection_info()
                .map_err(|e| UrlError(e.detail().unwrap_or("cannot parse a node").to_string()))?;
        }
        let mut b = ClusterClientBuilder::new(nodes)
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(Duration::from_secs(10))
            // Enough for a redirect or two while a slot moves; a node that stopped
            // answering costs a few timeouts, not a minute and a half, before the role's
            // own reconnect takes over (and finds the promoted replica).
            .retries(3)
            // Before each retry of a TRYAGAIN, CLUSTERDOWN or LOADING redis-rs sleeps, on
            // the thread that serves every shard: short sleeps (10 to 80 ms, at most 0.14 s
            // a call), as the held shard's own backoff (at most 1 s) does the waiting. Both
            // bounds are set: redis-rs's floor (1.28 s) is above any lower cap and wins, so
            // each retry slept 1.28 s and every call of a held shard held the mover, the
            // reader or a worker of all shards for 3.8 s.
            .min_retry_wait(10)
            .max_retry_wait(100);
        if let Some(c) = certs {
            b = b.certs(c);
        }
        let _ = p.query;
        b.build()
            .map(Redis::Cluster)
            .map_err(|e| UrlError(e.to_string()))
    }

    fn sentinel(url: &str, certs: Option<TlsCertificates>) -> Result<Redis, UrlError> {
        let p = parts(url)?;
        let mut path = p.path.trim_matches('/').split('/');
        let name = path.next().filter(|n| !n.is_empty()).ok_or_else(|| {
            UrlError("names no master: redis+sentinel://host:port,.../<master-name>".into())
        })?;
        let db: i64 = match path.next() {
            Some(d) => d
                .parse()
                .map_err(|_| UrlError(format!("database {d:?} is not a number")))?,
            None => 0,
        };
        if path.next().is_some() {
            return Err(UrlError(
                "has more after the database: redis+sentinel://host:port,.../<master-name>[/<db>]"
                    .into(),
            ));
        }
        let scheme = if p.tls { "rediss" } else { "redis" };
        let open = |url: &str| match &certs {
            Some(c) => redis::Client::build_with_tls(url, c.clone()),
            None => redis::Client::open(url),
        };
        let mut sentinels = Vec::new();
        for h in &p.hosts {
            let client = open(&format!("{scheme}://{h}/")).map_err(|e| {
                UrlError(format!(
                    "sentinel {h:?}: {}",
                    e.detail().unwrap_or("cannot parse it")
                ))
            })?;
            sentinels.push(client);
        }
        // The credentials in the URL are the servers' ones; checked now, used per master.
        open(&format!("{scheme}://{}x/{db}", p.auth)).map_err(|e| UrlError(e.to_string()))?;
        Ok(Redis::Sentinel(Arc::new(SentinelLink {
            sentinels,
            name: name.to_string(),
            scheme,
            auth: p.auth.to_string(),
            db,
            certs,
            answered: Default::default(),
            named: Mutex::new((None, None)),
        })))
    }

    pub fn topology(&self) -> Topology {
        match self {
            Redis::Single(_) => Topology::Single,
            Redis::Cluster(_) => Topology::Cluster,
            Redis::Sentinel(_) => Topology::Sentinel,
        }
    }

    /// Whether the client speaks TLS (one server only; the others say so in their URL).
    pub fn is_tls(&self) -> bool {
        match self {
            Redis::Single(c) => matches!(
                c.get_connection_info().addr(),
                ConnectionAddr::TcpTls { .. }
            ),
            _ => false,
        }
    }

    /// A connection whose reads and writes time out after `io_timeout`, so a Redis that
    /// stops answering cannot hang a thread past shutdown.
    pub fn connect_with(&self, io_timeout: Duration) -> RedisResult<Con> {
        self.connect_within(CONNECT_TIMEOUT, io_timeout)
    }

    /// [`Redis::connect_with`], connected within `connect_timeout` (a server or a Sentinel's
    /// master; a Cluster's nodes within [`CONNECT_TIMEOUT`]). Each reply of the setup
    /// (`HELLO`, `SELECT`, `CLIENT SETINFO`) may take that long again.
    pub fn connect_within(
        &self,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> RedisResult<Con> {
        match self {
            Redis::Single(client) => {
                let con = client.get_connection_with_timeout(connect_timeout)?;
                con.set_read_timeout(Some(io_timeout))?;
                con.set_write_timeout(Some(io_timeout))?;
                Ok(Con::Single(con))
            }
            Redis::Cluster(client) => {
                let con = client.get_connection()?;
                con.set_read_timeout(Some(io_timeout))?;
                con.set_write_timeout(Some(io_timeout))?;
                Ok(Con::Cluster(Box::new(con)))
            }
            Redis::Sentinel(sentinel) => {
                // The lookup asks the Sentinels and checks the master's ROLE; one thread
                // at a time, and never while holding it across the data connection.
                let client = sentinel.master()?;
                let con = client.get_connection_with_timeout(connect_timeout)?;
                con.set_read_timeout(Some(io_timeout))?;
                con.set_write_timeout(Some(io_timeout))?;
                Ok(Con::Sentinel(SentinelCon {
                    con,
                    master: host_port(client.get_connection_info().addr()),
                    link: sentinel.clone(),
                    replaced: None,
                }))
            }
        }
    }

    /// A connection for short commands (scripts, acks): 10 s I/O timeout.
    pub fn connect(&self) -> RedisResult<Con> {
        self.connect_with(Duration::from_secs(10))
    }
}

/// One connection: to a server, to a cluster, or to the master found through Sentinel.
pub enum Con {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
    Sentinel(SentinelCon),
}

/// A connection to the master the Sentinels named when it was made.
pub struct SentinelCon {
    con: redis::Connection,
    master: Option<HostPort>,
    link: Arc<SentinelLink>,
    /// The master the Sentinels named instead, once they did: the connection is lost.
    replaced: Option<HostPort>,
}

impl SentinelCon {
    /// `Err` (a lost connection) once the Sentinels name another master. Checked before
    /// every command, against the shared look-up, so that all connections leave the old
    /// master together: a worker acknowledging there after the reader moved on would leave
    /// the entries it read from the new master pending there.
    fn still_master(&mut self) -> RedisResult<&mut redis::Connection> {
        if self.replaced.is_none() {
            self.replaced = self
                .link
                .named_master()
                .filter(|named| Some(named) != self.master.as_ref());
        }
        match &self.replaced {
            None => Ok(&mut self.con),
            Some((host, port)) => Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                format!("the Sentinels now name {host}:{port} as the master"),
            )
            .into()),
        }
    }
}

impl Con {
    /// Sets the read and write timeout of every socket of the connection.
    pub fn set_io_timeout(&mut self, timeout: Duration) -> RedisResult<()> {
        match self {
            Con::Single(c) => {
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))
            }
            Con::Cluster(c) => {
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))
            }
            Con::Sentinel(c) => {
                c.con.set_read_timeout(Some(timeout))?;
                c.con.set_write_timeout(Some(timeout))
            }
        }
    }

    /// Whether this connection spans a cluster's nodes (multi-key reads must then stay
    /// within one hash slot per command).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Con::Cluster(_))
    }
}

impl ConnectionLike for Con {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<redis::Value> {
        match self {
            Con::Single(c) => c.req_packed_command(cmd),
            Con::Cluster(c) => c.req_packed_command(cmd),
            Con::Sentinel(c) => c.still_master()?.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<redis::Value>> {
        match self {
            Con::Single(c) => c.req_packed_commands(cmd, offset, count),
            Con::Cluster(c) => cluster_pipeline(c, cmd, offset, count),
            Con::Sentinel(c) => c.still_master()?.req_packed_commands(cmd, offset, count),
        }
    }

    fn req_command(&mut self, cmd: &redis::Cmd) -> RedisResult<redis::Value> {
        match self {
            Con::Single(c) => c.req_command(cmd),
            Con::Cluster(c) => c.req_command(cmd),
            Con::Sentinel(c) => c.still_master()?.req_command(cmd),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Con::Single(c) => c.get_db(),
            Con::Cluster(c) => c.get_db(),
            Con::Sentinel(c) => c.con.get_db(),
        }
    }

    /// See [`cluster_pipeline`].
    fn supports_pipelining(&self) -> bool {
        match self {
            Con::Single(c) => c.supports_pipelining(),
            Con::Cluster(_) => true,
            Con::Sentinel(c) => c.con.supports_pipelining(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Con::Single(c) => c.check_connection(),
            Con::Cluster(c) => c.check_connection(),
            Con::Sentinel(c) => c.still_master().is_ok_and(|c| c.check_connection()),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Con::Single(c) => c.is_open(),
            Con::Cluster(c) => c.is_open(),
            Con::Sentinel(c) => c.replaced.is_none() && c.con.is_open(),
        }
    }
}

/// A pipeline on a cluster. redis-rs's cluster connection would send it whole to the
/// node of its first key but turn any one command's error into an error of the whole
/// pipeline, and our figures read "no such key" from a stream not created yet as an
/// answer. So a plain pipeline runs command by command, each routed by its own key, its
/// server errors kept in place as a single server answers them; a transaction (`MULTI`)
/// goes whole to its node. Only the admin commands and the benchmark's queue probes
/// pipeline: the worker's own path is one script per step, and the benchmark's bulk load
/// one script call per batch of a shard's jobs (`pool::push_many`).
fn cluster_pipeline(
    con: &mut ClusterConnection,
    cmd: &[u8],
    offset: usize,
    count: usize,
) -> RedisResult<Vec<redis::Value>> {
    if cmd.starts_with(b"*1\r\n$5\r\nMULTI\r\n") {
        return con.req_packed_commands(cmd, offset, count);
    }
    let mut out = Vec::with_capacity(offset + count);
    let mut rest = cmd;
    while !rest.is_empty() && out.len() < offset + count {
        let (one, after) = packed_command(rest).ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::Client,
                "a pipelined command is not in the form redis-rs packs",
            ))
        })?;
        rest = after;
        match con.req_command(&one) {
            Ok(v) => out.push(v),
            Err(e) if e.kind() == redis::ErrorKind::Io || e.is_io_error() => return Err(e),
            Err(e) => match e.clone().into_server_errors() {
                Some(errs) if errs.len() == 1 => {
                    out.push(redis::Value::ServerError(errs[0].1.clone()))
                }
                _ => return Err(e),
            },
        }
    }
    Ok(out.into_iter().skip(offset).take(count).collect())
}

/// The first command of packed pipeline bytes (`*N\r\n` then N times `$len\r\n<bytes>\r\n`,
/// as redis-rs packs every command), and the bytes after it.
fn packed_command(b: &[u8]) -> Option<(redis::Cmd, &[u8])> {
    fn line(b: &[u8], tag: u8) -> Option<(usize, &[u8])> {
        let rest = b.strip_prefix(&[tag])?;
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        let n = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
        Some((n, &rest[end + 2..]))
    }
    let (n, mut rest) = line(b, b'*')?;
    let mut cmd = redis::Cmd::new();
    for _ in 0..n {
        let (len, after) = line(rest, b'$')?;
        let arg = after.get(..len)?;
        cmd.arg(arg);
        rest = after.get(len..)?.strip_prefix(b"\r\n")?;
    }
    Some((cmd, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_by_scheme() {
        assert_eq!(Topology::of("redis://h:1/"), Topology::Single);
        assert_eq!(Topology::of("rediss://h:1/"), Topology::Single);
        assert_eq!(Topology::of("redis+cluster://a:1,b:2"), Topology::Cluster);
        assert_eq!(Topology::of("rediss+cluster://a:1"), Topology::Cluster);
        assert_eq!(Topology::of("redis+sentinel://a:1/m"), Topology::Sentinel);
    }

    #[test]
    fn packed_pipelines_split_into_their_commands() {
        let mut p = redis::pipe();
        p.cmd("XLEN").arg("{mq}:events");
        p.cmd("EVAL")
            .arg("return 1")
            .arg(1)
            .arg("k\r\nx")
            .arg(&b"\x00\xff"[..]);
        let packed = p.get_packed_pipeline();
        let (a, rest) = packed_command(&packed).unwrap();
        assert_eq!(
            a.get_packed_command(),
            redis::cmd("XLEN").arg("{mq}:events").get_packed_command()
        );
        let (b, rest) = packed_command(rest).unwrap();
        assert_eq!(
            b.get_packed_command(),
            redis::cmd("EVAL")
                .arg("return 1")
                .arg(1)
                .arg("k\r\nx")
                .arg(&b"\x00\xff"[..])
                .get_packed_command()
        );
        assert!(rest.is_empty());
        assert!(packed_command(b"*1\r\n$5\r\nXL").is_none());
    }

    #[test]
    fn urls_parse_or_say_why() {
        assert!(Redis::open("redis+cluster://127.0.0.1:1,127.0.0.1:2", None).is_ok());
        assert!(Redis::open("redis+cluster://:pw@127.0.0.1:1/", None).is_ok());
        let e = Redis::open("redis+cluster://127.0.0.1:1/3", None).unwrap_err();
        assert!(e.0.contains("database 0"), "{e}");
        assert!(Redis::open("redis+cluster://", None).is_err());
        assert!(Redis::open("redis+sentinel://127.0.0.1:1,127.0.0.1:2/m/2", None).is_ok());
        let e = Redis::open("redis+sentinel://127.0.0.1:1", None).unwrap_err();
        assert!(e.0.contains("names no master"), "{e}");
        let e = Redis::open("redis+sentinel://127.0.0.1:1/m/x", None).unwrap_err();
        assert!(e.0.contains("not a number"), "{e}");
    }
}

#[cfg(test)]
mod redaction {
    #[test]
    fn cluster_and_sentinel_urls_are_redacted() {
        for url in [
            "redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7000",
            "rediss+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7000/",
            "redis+sentinel://app:s3cret@10.0.0.1:26379,10.0.0.2:26379/mymaster/2",
        ] {
            let shown = crate::config::redact_url(url);
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("10.0.0.2"), "{shown}");
        }
    }
}
