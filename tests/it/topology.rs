//! Real Redis topologies for the tests: a Redis Cluster of three masters with a replica
//! each, and a master with one replica watched by three Sentinels. Each runs as child
//! processes of the test on free loopback ports, in a directory of its own, and is killed
//! and removed on drop. Their logs stay in that directory and are printed (the last lines
//! of each) only when the test fails.
//!
//! Both fail over fast (a master that has not answered for 2 s is failed over; its
//! replica takes its place 3 to 4 s after the kill), yet not so fast that a loaded machine
//! makes them fail over by themselves.

#![allow(dead_code)]

use crate::support::*;
use delay_worker::keys::Keys;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long any topology step may take on a loaded machine before the test fails.
const UP: Duration = Duration::from_secs(60);

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn temp_dir(prefix: &str) -> PathBuf {
    let dir = scratch_dir().join(format!(
        "{prefix}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `n` distinct free loopback ports ([`free_port`]).
fn free_ports(n: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    while ports.len() < n {
        let p = free_port();
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    ports
}

/// A plain connection to one server, with short timeouts: `None` if it does not answer.
pub fn try_con(port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let con = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .ok()?;
    con.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    con.set_write_timeout(Some(Duration::from_secs(5))).ok()?;
    Some(con)
}

/// A plain connection to one server, with short timeouts, or why not.
fn con_or_err(port: u16) -> redis::RedisResult<redis::Connection> {
    let con = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(2))?;
    con.set_read_timeout(Some(Duration::from_secs(15)))?;
    con.set_write_timeout(Some(Duration::from_secs(15)))?;
    Ok(con)
}

/// `f`, tried again for up to [`UP`] while it fails without an answer from the server (a
/// connection refused, cut, or killed by a test's fault); panics with `what` otherwise.
fn retrying<T>(what: &str, mut f: impl FnMut() -> redis::RedisResult<T>) -> T {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if e.code().is_none() && start.elapsed() < UP => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// The node id of the server on `port` (`CLUSTER MYID`).
fn node_id(port: u16) -> String {
    retrying(&format!("CLUSTER MYID on {port}"), || {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut con_or_err(port)?)
    })
}

/// A plain connection to one server; panics if it does not answer.
pub fn con_to(port: u16) -> redis::Connection {
    try_con(port).unwrap_or_else(|| panic!("redis on port {port} does not answer"))
}

/// `INFO <section>` of one server as `field -> value`; empty if it does not answer.
pub fn info(port: u16, section: &str) -> std::collections::HashMap<String, String> {
    let Some(mut con) = try_con(port) else {
        return Default::default();
    };
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query(&mut con)
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// One server process of a topology.
struct Node {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl Node {
    /// Starts `redis-server` with `args` (its log to `<dir>/<port>.log`) and waits until it answers.
    fn start(dir: &Path, port: u16, args: &[String]) -> Node {
        let log = dir.join(format!("{port}.log"));
        let child = Command::new("redis-server")
            .args(args)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run scripts/services.sh install");
        let mut node = Node {
            port,
            child: Some(child),
            log,
        };
        wait_until(
            UP,
            &format!("redis-server on port {port} to answer"),
            || {
                if let Some(status) = node.child.as_mut().unwrap().try_wait().unwrap() {
                    panic!(
                        "redis-server on port {port} exited at start ({status}):\n{}",
                        node.log_tail(20)
                    );
                }
                // Answering, and as this child (not another test's server on a reused port).
                let pid = node.child.as_ref().unwrap().id().to_string();
                info(port, "server").get("process_id") == Some(&pid)
            },
        );
        node
    }

    fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Kills every node, prints their logs' last lines if the test is failing, removes `dir`.
fn tear_down(nodes: &mut [Node], dir: &Path) {
    for n in nodes.iter_mut() {
        n.kill();
    }
    if std::thread::panicking() {
        for n in nodes.iter() {
            eprintln!("---- redis {} ----\n{}", n.port, n.log_tail(30));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

// ---- Redis Cluster -----------------------------------------------------------------------

/// A Redis Cluster of three masters and three replicas (one each) on loopback.
pub struct Cluster {
    dir: PathBuf,
    nodes: Vec<Node>,
    /// The replica expected to take over from the master `kill_master_of` killed.
    promoting: Option<u16>,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub flags: Vec<String>,
    pub master_id: String,
    /// Slot ranges served (masters only), inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    pub fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    pub fn failed(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?")
    }

    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    }
}

impl Cluster {
    /// Starts six nodes, joins them with `redis-cli --cluster create` and waits until
    /// every node sees all 16384 slots served and each replica is in sync.
    pub fn start() -> Cluster {
        Cluster::start_with(&[])
    }

    /// [`Cluster::start`] with extra `redis-server` arguments for every node, e.g.
    /// `["--enable-debug-command", "local"]`.
    pub fn start_with(extra: &[&str]) -> Cluster {
        let dir = temp_dir("dw-cluster");
        // The cluster bus gets a free port of its own (`port + 10000` may not exist).
        let ports = free_ports(12);
        let mut nodes = Vec::new();
        for i in 0..6 {
            let (port, bus) = (ports[i], ports[6 + i]);
            let args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &bus.to_string(),
                "--cluster-config-file",
                &dir.join(format!("nodes-{port}.conf")).display().to_string(),
                "--cluster-node-timeout",
                "2000",
                // A replica's first sync starts at once (the default waits 5 s for more).
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
                "--dir",
                &dir.display().to_string(),
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect();
            nodes.push(Node::start(&dir, port, &args));
        }
        let cluster = Cluster {
            dir,
            nodes,
            promoting: None,
        };
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(ports[..6].iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli is not installed: run scripts/services.sh install");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        cluster.wait_healthy();
        cluster
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.alive())
            .map(|n| n.port)
            .collect()
    }

    /// `CLUSTER NODES` as one live node sees it.
    pub fn nodes_seen_by(port: u16) -> Option<Vec<ClusterNode>> {
        let mut con = try_con(port)?;
        let text: String = redis::cmd("CLUSTER").arg("NODES").query(&mut con).ok()?;
        Some(text.lines().filter_map(parse_cluster_node).collect())
    }

    fn nodes_view(&self) -> Vec<ClusterNode> {
        self.live_ports()
            .into_iter()
            .find_map(Cluster::nodes_seen_by)
            .expect("no cluster node answers CLUSTER NODES")
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut con_to(port))
            .unwrap()
    }

    /// The port of the master serving `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        self.master_serving(self.slot_of(key))
    }

    /// The port of the master serving `slot`.
    pub fn master_serving(&self, slot: u16) -> u16 {
        self.nodes_view()
            .into_iter()
            .find(|n| n.is_master() && !n.failed() && n.serves(slot))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
            .port
    }

    /// The ports of the masters serving slots.
    pub fn masters(&self) -> Vec<u16> {
        self.nodes_view()
            .into_iter()
            .filter(|n| n.is_master() && !n.failed() && !n.slots.is_empty())
            .map(|n| n.port)
            .collect()
    }

    /// Starts resharding `slot` from the master on `from` to the one on `to`, as
    /// `redis-cli --cluster reshard` does: IMPORTING on the target, MIGRATING on the
    /// source. The slot's keys stay where they are until [`Cluster::migrate_keys`].
    pub fn begin_reshard(&self, slot: u16, from: u16, to: u16) {
        let (from_id, to_id) = (node_id(from), node_id(to));
        let set = |port: u16, how: &str, node: &str| {
            retrying(&format!("CLUSTER SETSLOT {slot} {how} on {port}"), || {
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg(how)
                    .arg(node)
                    .query::<()>(&mut con_or_err(port)?)
            })
        };
        set(to, "IMPORTING", &from_id);
        set(from, "MIGRATING", &to_id);
    }

    /// Moves `keys` (of a slot being resharded) from `from` to `to` with MIGRATE.
    pub fn migrate_keys(&self, from: u16, to: u16, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        let mut tries = 0;
        let reply: String = retrying(&format!("MIGRATE from {from} to {to}"), || {
            tries += 1;
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(10_000)
                .arg("KEYS")
                .arg(keys)
                .query(&mut con_or_err(from)?)
        });
        // A MIGRATE tried again after its connection failed may find its keys moved.
        assert!(
            reply == "OK" || (tries > 1 && reply == "NOKEY"),
            "MIGRATE: {reply}"
        );
    }

    /// The keys of `slot` still on the master on `port` (at most `count`).
    pub fn keys_in_slot(&self, port: u16, slot: u16, count: usize) -> Vec<String> {
        retrying(&format!("CLUSTER GETKEYSINSLOT {slot} on {port}"), || {
            redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(count)
                .query(&mut con_or_err(port)?)
        })
    }

    /// Ends the reshard of `slot`: every key still on `from` migrated, then the slot
    /// given to `to` on every master.
    pub fn end_reshard(&self, slot: u16, from: u16, to: u16) {
        loop {
            let keys = self.keys_in_slot(from, slot, 1000);
            if keys.is_empty() {
                break;
            }
            self.migrate_keys(from, to, &keys);
        }
        let to_id = node_id(to);
        for port in [to, from].into_iter().chain(
            self.masters()
                .into_iter()
                .filter(|p| *p != to && *p != from),
        ) {
            retrying(&format!("CLUSTER SETSLOT {slot} NODE on {port}"), || {
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&to_id)
                    .query::<()>(&mut con_or_err(port)?)
            });
        }
        wait_until(UP, "every node to route the slot to its new master", || {
            self.live_ports().into_iter().all(|p| {
                Cluster::nodes_seen_by(p).is_some_and(|v| {
                    v.iter()
                        .any(|n| n.port == to && n.is_master() && n.serves(slot))
                })
            })
        });
    }

    /// The port of the replica of the master on `master`.
    pub fn replica_of(&self, master: u16) -> u16 {
        let view = self.nodes_view();
        let id = &view.iter().find(|n| n.port == master).unwrap().id;
        view.iter()
            .find(|n| !n.is_master() && &n.master_id == id)
            .unwrap_or_else(|| panic!("the master on {master} has no replica"))
            .port
    }

    /// A plain connection to the master serving `key` (enough for a key set under one
    /// hash tag: every key of it lives there).
    pub fn con_for(&self, key: &str) -> redis::Connection {
        con_to(self.master_of(key))
    }

    /// SIGKILLs the master serving `key`; returns (its port, its replica's port).
    pub fn kill_master_of(&mut self, key: &str) -> (u16, u16) {
        let master = self.master_of(key);
        let replica = self.replica_of(master);
        self.nodes
            .iter_mut()
            .find(|n| n.port == master)
            .unwrap()
            .kill();
        self.promoting = Some(replica);
        (master, replica)
    }

    /// A manual failover (`CLUSTER FAILOVER` on the replica of the master serving `key`):
    /// the master pauses its clients until the replica has caught up, then the replica
    /// takes its slots and the master becomes its replica. Nothing is lost. Waits until
    /// every node routes to the new master; returns (old master, new master).
    pub fn switchover_of(&mut self, key: &str) -> (u16, u16) {
        let master = self.master_of(key);
        let replica = self.replica_of(master);
        let ok: String = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query(&mut con_to(replica))
            .unwrap();
        assert_eq!(ok, "OK");
        self.promoting = Some(replica);
        self.wait_failover();
        wait_until(UP, "the old master to follow the new one", || {
            let i = info(master, "replication");
            i.get("role").map(String::as_str) == Some("slave")
                && i.get("master_link_status").map(String::as_str) == Some("up")
        });
        (master, replica)
    }

    /// Waits until the replica of the killed master serves its slots and every live node
    /// says `cluster_state:ok`.
    pub fn wait_failover(&self) {
        let replica = self.promoting.expect("kill_master_of first");
        wait_until(UP, "the replica to be promoted", || {
            info(replica, "replication").get("role").map(String::as_str) == Some("master")
        });
        self.wait_healthy();
        // Every live node routes to the new master.
        wait_until(UP, "every node to know the new master", || {
            self.live_ports().into_iter().all(|p| {
                Cluster::nodes_seen_by(p).is_some_and(|v| {
                    v.iter()
                        .any(|n| n.port == replica && n.is_master() && !n.slots.is_empty())
                })
            })
        });
    }

    /// Every live node: `cluster_state:ok`, all slots served; every live replica in sync.
    fn wait_healthy(&self) {
        wait_until(UP, "cluster_state:ok on every node", || {
            self.live_ports().into_iter().all(|p| {
                let Some(mut con) = try_con(p) else {
                    return false;
                };
                let text: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut con)
                    .unwrap_or_default();
                text.contains("cluster_state:ok") && text.contains("cluster_slots_ok:16384")
            })
        });
        wait_until(UP, "every replica in sync", || {
            self.live_ports().into_iter().all(|p| {
                let i = info(p, "replication");
                match i.get("role").map(String::as_str) {
                    Some("master") => true,
                    Some("slave") => {
                        // A replica of the killed master waits for nothing.
                        i.get("master_link_status").map(String::as_str) == Some("up")
                            || !self
                                .live_ports()
                                .iter()
                                .any(|lp| i.get("master_port") == Some(&lp.to_string()))
                    }
                    _ => false,
                }
            })
        });
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        tear_down(&mut self.nodes, &self.dir);
    }
}

fn parse_cluster_node(line: &str) -> Option<ClusterNode> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 8 {
        return None;
    }
    // `ip:port@bus[,hostname]`
    let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
    let slots = f[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => s.parse().ok().map(|a| (a, a)),
        })
        .collect();
    Some(ClusterNode {
        id: f[0].to_string(),
        port,
        flags: f[2].split(',').map(str::to_string).collect(),
        master_id: f[3].to_string(),
        slots,
    })
}

// ---- Redis Sentinel ----------------------------------------------------------------------

/// The name the Sentinels monitor the master under.
pub const MASTER_NAME: &str = "dwmaster";

/// A master, one replica, and three Sentinels (quorum 2) monitoring them.
pub struct Sentinel {
    dir: PathBuf,
    /// master, replica, then the three Sentinels.
    nodes: Vec<Node>,
    pub master: u16,
    pub replica: u16,
    pub sentinels: Vec<u16>,
}

impl Sentinel {
    pub fn start() -> Sentinel {
        Sentinel::start_with(&[])
    }

    /// The same, with a master that cannot be made a replica (`REPLICAOF` renamed away):
    /// after a failover it stays a writable master of its own, as one cut off from the
    /// Sentinels would, and only the Sentinels say it is no longer the master.
    pub fn start_with_a_stubborn_master() -> Sentinel {
        Sentinel::start_with(&[
            "--rename-command".into(),
            "REPLICAOF".into(),
            "".into(),
            "--rename-command".into(),
            "SLAVEOF".into(),
            "".into(),
        ])
    }

    fn start_with(master_extra: &[String]) -> Sentinel {
        let dir = temp_dir("dw-sentinel");
        let ports = free_ports(5);
        let (master, replica) = (ports[0], ports[1]);
        let server = |port: u16, extra: &[String]| -> Vec<String> {
            let mut a: Vec<String> = [
                "--port",
                &port.to_string(),
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--bind",
                "127.0.0.1",
                "--dir",
                &dir.display().to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            a.extend_from_slice(extra);
            a
        };
        let mut nodes = vec![Node::start(&dir, master, &server(master, master_extra))];
        nodes.push(Node::start(
            &dir,
            replica,
            &server(
                replica,
                &["--replicaof".into(), "127.0.0.1".into(), master.to_string()],
            ),
        ));
        wait_until(UP, "the replica in sync", || {
            info(replica, "replication")
                .get("master_link_status")
                .map(String::as_str)
                == Some("up")
        });
        for &port in &ports[2..] {
            let conf = dir.join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\n\
                     bind 127.0.0.1\n\
                     dir {dir}\n\
                     sentinel resolve-hostnames no\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 2000\n\
                     sentinel failover-timeout {MASTER_NAME} 5000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n",
                    dir = dir.display()
                ),
            )
            .unwrap();
            nodes.push(Node::start(
                &dir,
                port,
                &[conf.display().to_string(), "--sentinel".into()],
            ));
        }
        let s = Sentinel {
            dir,
            nodes,
            master,
            replica,
            sentinels: ports[2..].to_vec(),
        };
        // Each Sentinel knows the replica and the two others (they find each other through
        // the master within a few seconds), so a failover can be authorized.
        wait_until(
            UP,
            "the Sentinels to know the replica and each other",
            || {
                s.sentinels.iter().all(|&p| {
                    let Some(mut con) = try_con(p) else {
                        return false;
                    };
                    let quorum = redis::cmd("SENTINEL")
                        .arg("CKQUORUM")
                        .arg(MASTER_NAME)
                        .query::<String>(&mut con)
                        .is_ok_and(|r| r.contains("3 usable Sentinels"));
                    let replicas: Vec<std::collections::HashMap<String, String>> =
                        redis::cmd("SENTINEL")
                            .arg("REPLICAS")
                            .arg(MASTER_NAME)
                            .query(&mut con)
                            .unwrap_or_default();
                    quorum
                        && replicas.iter().any(|r| {
                            r.get("port") == Some(&replica.to_string())
                                && r.get("flags").map(String::as_str) == Some("slave")
                        })
                })
            },
        );
        s
    }

    /// `redis+sentinel://` naming the three Sentinels and the master's name.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .sentinels
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", seeds.join(","))
    }

    /// The master's port as the Sentinel on `sentinel` names it.
    pub fn master_seen_by(sentinel: u16) -> Option<u16> {
        let mut con = try_con(sentinel)?;
        let addr: Option<(String, String)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER_NAME)
            .query(&mut con)
            .ok()?;
        addr?.1.parse().ok()
    }

    /// The master's port as the first answering Sentinel names it.
    pub fn current_master(&self) -> u16 {
        self.sentinels
            .iter()
            .find_map(|&p| Sentinel::master_seen_by(p))
            .expect("no Sentinel names a master")
    }

    /// A plain connection to the current master.
    pub fn master_con(&self) -> redis::Connection {
        con_to(self.current_master())
    }

    /// SIGKILLs the master.
    pub fn kill_master(&mut self) {
        let master = self.master;
        self.nodes
            .iter_mut()
            .find(|n| n.port == master)
            .unwrap()
            .kill();
    }

    /// Waits until every Sentinel names the replica as the master, it says `role:master`,
    /// and the Sentinels have finished the failover.
    pub fn wait_failover(&mut self) {
        let replica = self.replica;
        wait_until(UP, "the Sentinels to promote the replica", || {
            self.sentinels
                .iter()
                .all(|&p| Sentinel::master_seen_by(p) == Some(replica))
                && info(replica, "replication").get("role").map(String::as_str) == Some("master")
        });
        wait_until(UP, "the failover to end", || {
            self.sentinels.iter().all(|&p| {
                try_con(p).is_some_and(|mut con| {
                    redis::cmd("SENTINEL")
                        .arg("MASTER")
                        .arg(MASTER_NAME)
                        .query::<std::collections::HashMap<String, String>>(&mut con)
                        .is_ok_and(|m| {
                            m.get("flags")
                                .is_some_and(|f| !f.contains("failover_in_progress"))
                        })
                })
            })
        });
        self.master = replica;
    }

    /// A planned failover (`SENTINEL FAILOVER`) while the master runs: waits until the
    /// replica is promoted and every Sentinel names it; `master` and `replica` are then
    /// swapped. The Sentinels turn the old master into a replica of the new one only some
    /// seconds later (and not at all if it is stubborn); until then it is a master too.
    pub fn switchover(&mut self) {
        let old = self.master;
        let ok: String = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER_NAME)
            .query(&mut con_to(self.sentinels[0]))
            .unwrap();
        assert_eq!(ok, "OK");
        self.wait_failover();
        self.replica = old;
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        tear_down(&mut self.nodes, &self.dir);
    }
}

/// Cuts the replica on `replica` off its master on `master`: it may not log in again (a
/// user that does not exist), and its link is closed. The master goes on acknowledging
/// writes it no longer sends on: the window in which an asynchronous failover loses them.
/// Returns the moment just before the link was closed: a write sent after it may be
/// missing on the replica, one acknowledged before it was on its way there.
pub fn cut_replica_link(master: u16, replica: u16) -> Instant {
    let mut con = con_to(replica);
    for (name, value) in [("masteruser", "no-such-user"), ("masterauth", "x")] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query::<()>(&mut con)
            .unwrap();
    }
    let mut con = con_to(master);
    let cut = Instant::now();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut con)
        .unwrap();
    assert_eq!(killed, 1, "the replica's link closed");
    cut
}

// ---- the shop's books on a topology -------------------------------------------------------

/// Entries added to the stream that the group has not read yet (`XINFO GROUPS` lag);
/// `None` when Redis cannot tell or the group does not exist.
pub fn group_lag(con: &mut redis::Connection, keys: &Keys) -> Option<i64> {
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&keys.stream)
        .query(con)
        .ok()?;
    let g = groups.into_iter().find(|g| {
        g.get("name")
            .map(delay_worker::store::value_to_string)
            .as_deref()
            == Some(keys.group.as_str())
    })?;
    match g.get("lag") {
        Some(redis::Value::Int(n)) => Some(*n),
        _ => None,
    }
}

/// Pushes an `order.timeout` for each order on `con`, due `delay_ms` from now.
pub fn push_timeouts_on(
    con: &mut redis::Connection,
    keys: &Keys,
    orders: &[SeedOrder],
    delay_ms: i64,
) {
    for o in orders {
        push_timeout(con, keys, o, delay_ms).unwrap();
    }
}

/// The job key of an order's timeout.
pub fn timeout_key(o: &SeedOrder) -> String {
    format!("order.timeout:{}", o.order_no)
}

/// Pushes one order's `order.timeout`, due `delay_ms` from now.
pub fn push_timeout(
    con: &mut redis::Connection,
    keys: &Keys,
    o: &SeedOrder,
    delay_ms: i64,
) -> Result<delay_worker::producer::Pushed, delay_worker::producer::PushError> {
    let now = delay_worker::now_ms();
    let job = delay_worker::producer::NewJob {
        event: "order.timeout".into(),
        payload: serde_json::json!({ "order_no": o.order_no }),
        due_ms: now + delay_ms,
        key: Some(timeout_key(o)),
    };
    delay_worker::producer::push(con, keys, &job, now)
}

/// `WAIT 1 <timeout_ms>` on `con`: whether every write made on it so far reached the
/// replica.
pub fn replicated(con: &mut redis::Connection, timeout_ms: u64) -> bool {
    redis::cmd("WAIT")
        .arg(1)
        .arg(timeout_ms)
        .query::<i64>(con)
        .is_ok_and(|n| n >= 1)
}

/// The inbox's job keys, with how many rows (runs) each has.
pub fn inbox_keys(db: &TestDb) -> std::collections::HashMap<String, i64> {
    db.client()
        .query(
            "SELECT job_key, count(*) FROM worker_inbox GROUP BY job_key",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Order numbers of the cancelled orders.
pub fn cancelled_orders(db: &TestDb) -> std::collections::HashSet<String> {
    db.client()
        .query(
            "SELECT order_no FROM orders WHERE status = 'cancelled'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A config for the worker binary on `redis_url` with the shop's database (the flags
/// `Proc::start` passes come from it).
pub fn config_for(redis_url: &str, db: &TestDb, consumer: &str) -> delay_worker::Config {
    let mut config = delay_worker::Config::new(redis_url, &db.url);
    config.threads = 4;
    config.consumer = consumer.into();
    config
}

/// Stops the worker gracefully (exit 0), checks the books (every order not in `paid`
/// cancelled once, stock and coupons exact) and returns how often each job key ran.
pub fn stop_and_account(
    p: &mut Proc,
    db: &TestDb,
    orders: &[SeedOrder],
    paid: &[SeedOrder],
) -> std::collections::HashMap<String, i64> {
    p.signal(libc::SIGTERM);
    assert!(
        p.wait(std::time::Duration::from_secs(90)).success(),
        "{}",
        p.log()
    );
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(db, orders, &cancelled);
    inbox_keys(db)
}
