//! HTTP/1.1 for the operator's endpoints (`--metrics-addr`): accept, read a request by its
//! deadlines, write an answer, and share the connection slots fairly among clients that
//! stall. Nothing here knows what is served: the caller's handler answers each [`Request`]
//! with a [`Response`] (`metrics.rs` routes them). The head is parsed by `httparse`, a body
//! of at most [`MAX_BODY`] bytes is read by its `Content-Length`; `Connection: close`
//! always.
//!
//! **Slow clients cannot starve it.** The thread blocks in `accept` and hands each
//! connection to a thread of its own, at most [`MAX_CONNECTIONS`] at once. A connection
//! must deliver its whole request within [`REQUEST_DEADLINE`] (a head of at most
//! [`MAX_HEAD`] bytes) and take its answer within [`WRITE_TIMEOUT`], else it is closed
//! (with `408` if it sent part of a request). When every slot is taken, the connection that
//! has been sending its request longest (at least [`STALLED`]) is closed to make room, so a
//! new request never waits behind clients that connect and stall, however many there are.
//! Clients that stall and reconnect at once keep every slot younger than that: then a new
//! connection that has sent its whole request head (within [`WHOLE_HEAD_WAIT`]) takes the
//! slot of the oldest one whose thread waits for more of its request, whatever its age, so
//! a probe is answered through such a flood. Only when every slot is busy answering
//! (answers take milliseconds, a health check at most `health::HEALTH_TIMEOUT`) or holds a
//! request not read yet does a new connection get `503` (at once, or after looking for
//! room for [`EVICT_WAIT`] when it sent a whole request), and a request that was sent
//! whole is never closed unanswered. Nothing is queued.
//!
//! **How it stops.** On shutdown a helper thread of the listener closes the connections
//! still open and wakes the blocked `accept` by connecting to the listener itself; the
//! connection threads end with the caller's thread scope.

use crate::shutdown::Shutdown;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown as Close;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::Scope;
use std::time::{Duration, Instant};

/// Connections served at once, one thread each.
pub const MAX_CONNECTIONS: usize = 16;
/// A client must have sent its whole request (head and body) within this of connecting.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(1);
/// A client that does not take its answer within this is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest request head (request line and headers): `431` beyond.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest request body: `413` beyond.
pub const MAX_BODY: usize = 64 * 1024;
/// Most request headers: `431` beyond.
const MAX_HEADERS: usize = 32;
/// Stack of a connection thread: rendering the exposition needs little.
const CONNECTION_STACK: usize = 256 * 1024;
/// How long the accepting thread waits for a connection it closed to free its slot.
const EVICT_WAIT: Duration = Duration::from_millis(200);
/// A connection still sending its request after this long may be closed to make room for
/// a new one; a client that sends its request at once is read well within it.
const STALLED: Duration = Duration::from_millis(250);
/// How long a new connection that finds every slot young may take to send its whole
/// request head, to take the slot of a client still sending its own.
const WHOLE_HEAD_WAIT: Duration = Duration::from_millis(20);
/// A connection that has sent nothing for this long since it connected may be closed to
/// make room for a whole request; a client sends its request at once.
const SILENT: Duration = Duration::from_millis(100);

/// One request as read from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path, without its query string.
    pub path: String,
    /// What followed `?`, as sent.
    pub query: String,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// Every header as sent, names lower-cased (at most [`MAX_HEADERS`]).
    pub headers: Vec<(String, String)>,
    /// The body (`Content-Length` bytes, at most [`MAX_BODY`]).
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of this (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One answer; always sent with `Connection: close`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    /// The `Allow` header of a `405`.
    pub allow: Option<&'static str>,
    /// More headers (the status page's security headers).
    pub headers: Vec<(&'static str, &'static str)>,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            allow: None,
            headers: Vec::new(),
        }
    }

    fn write_to(&self, w: &mut impl Write, head_only: bool) -> std::io::Result<()> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            413 => "Content Too Large",
            415 => "Unsupported Media Type",
            431 => "Request Header Fields Too Large",
            501 => "Not Implemented",
            503 => "Service Unavailable",
            _ => "",
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if let Some(allow) = self.allow {
            out.push_str(&format!("Allow: {allow}\r\n"));
        }
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str("\r\n");
        // The body on its own: a page is not copied once more behind its head.
        w.write_all(out.as_bytes())?;
        if !head_only {
            w.write_all(self.body.as_bytes())?;
        }
        w.flush()
    }
}

/// What answers a request.
pub type Handler<'h> = dyn Fn(&Request) -> Response + Sync + 'h;

/// A bound listener and its connection slots; `name` begins its log lines and names its
/// threads.
pub struct Listener {
    listener: TcpListener,
    slots: Slots,
    stopped: AtomicBool,
    name: &'static str,
}

impl Listener {
    /// Binds now, so a port in use stops the start with one readable line.
    pub fn bind(addr: SocketAddr, name: &'static str) -> std::io::Result<Listener> {
        Ok(Listener {
            listener: TcpListener::bind(addr)?,
            slots: Slots::default(),
            stopped: AtomicBool::new(false),
            name,
        })
    }

    /// The address actually bound (port 0 picks one).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Starts the thread that stops the listener at shutdown (see the module header);
    /// `false`, said in the log, when it cannot start: then do not serve, since a
    /// blocked accept could not be woken.
    pub fn start_stopper<'s>(&'s self, s: &'s Scope<'s, '_>, shutdown: &'s Shutdown) -> bool {
        let waker = std::thread::Builder::new()
            .name(format!("{}-stop", self.name))
            .spawn_scoped(s, move || {
                // Disconnected (an error) exactly when shutdown is triggered.
                let _ = shutdown.receiver().recv();
                self.slots.close_all();
                self.wake_accept();
            });
        if let Err(e) = waker {
            log::error!(
                "{}: cannot start its stop thread, not serving: {e}",
                self.name
            );
            return false;
        }
        true
    }

    /// Accepts until shutdown, each connection on a thread of `s`, answered by `handler`.
    pub fn serve<'s>(
        &'s self,
        s: &'s Scope<'s, '_>,
        shutdown: &Shutdown,
        handler: &'s Handler<'s>,
    ) {
        self.accept_loop(s, shutdown, handler);
        self.stopped.store(true, Relaxed);
    }

    fn accept_loop<'s>(
        &'s self,
        s: &'s Scope<'s, '_>,
        shutdown: &Shutdown,
        handler: &'s Handler<'s>,
    ) {
        while !shutdown.is_set() {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted
                            | ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    // Out of file descriptors and the like: say so, and do not spin.
                    log::warn!("{}: accept failed: {e}", self.name);
                    shutdown.wait(Duration::from_secs(1));
                    continue;
                }
            };
            if shutdown.is_set() {
                break;
            }
            let Some(id) = self.slots.admit(&stream, self.name) else {
                log::debug!("{}: every connection slot is answering; 503", self.name);
                refuse(stream);
                continue;
            };
            let spawned = std::thread::Builder::new()
                .name(format!("{}-conn", self.name))
                .stack_size(CONNECTION_STACK)
                .spawn_scoped(s, move || {
                    let _leave = Leave(&self.slots, id);
                    self.answer(stream, id, handler);
                });
            if let Err(e) = spawned {
                // The closure, and the connection with it, is dropped: closed.
                self.slots.leave(id);
                log::warn!("{}: cannot start a connection thread: {e}", self.name);
            }
        }
    }

    /// Connects to the listener until the accepting thread has noticed the shutdown.
    fn wake_accept(&self) {
        let Ok(mut addr) = self.local_addr() else {
            return;
        };
        match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => addr.set_ip(Ipv4Addr::LOCALHOST.into()),
            IpAddr::V6(ip) if ip.is_unspecified() => addr.set_ip(Ipv6Addr::LOCALHOST.into()),
            _ => {}
        }
        let mut warned = false;
        while !self.stopped.load(Relaxed) {
            if let Err(e) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                if !warned {
                    log::warn!(
                        "{}: cannot reach {addr} to stop the listener: {e}; retrying",
                        self.name
                    );
                    warned = true;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One request, one answer, close. Errors writing mean the client went away: there
    /// is nobody left to tell, so they are dropped.
    fn answer(&self, mut stream: TcpStream, id: u64, handler: &Handler<'_>) {
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let deadline = Instant::now() + REQUEST_DEADLINE;
        let waiting = |w: bool, started: bool| self.slots.waiting(id, w, started);
        let (response, head_only) = match read_request(&mut stream, deadline, &waiting) {
            Ok(req) => {
                if !self.slots.answering(id) {
                    return; // closed to make room for a newer connection
                }
                (handler(&req), req.method == "HEAD")
            }
            Err(Some(r)) => (r, false),
            Err(None) => return,
        };
        let _ = response.write_to(&mut stream, head_only);
        let _ = stream.shutdown(Close::Write);
    }
}

/// The open connections: at most [`MAX_CONNECTIONS`], each with a handle to close it.
#[derive(Default)]
struct Slots {
    open: Mutex<Vec<Open>>,
    /// Signalled whenever a connection leaves.
    freed: Condvar,
    next_id: AtomicU64,
}

type OpenGuard<'a> = MutexGuard<'a, Vec<Open>>;

struct Open {
    id: u64,
    /// A second handle on the connection's socket, to close it from another thread.
    handle: TcpStream,
    since: Instant,
    state: ConnState,
    /// Its thread waits in a read for more of its request (the request is not whole).
    waiting: bool,
    /// Part of its request has come.
    started: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Still receiving its request: may be closed to make room.
    Reading,
    Answering,
    /// Closed from outside; its thread is on its way out.
    Closed,
}

/// Leaves the slot when the connection thread ends, however it ends.
struct Leave<'a>(&'a Slots, u64);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

impl Slots {
    fn lock(&self) -> OpenGuard<'_> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for `stream`, closing the connection that has been reading its request the
    /// longest (at least [`STALLED`]) when none is free, or, for a connection that has
    /// sent its whole request head, the oldest one whose thread waits for more of its
    /// request; `None` when every slot is answering or has just connected.
    fn admit(&self, stream: &TcpStream, name: &str) -> Option<u64> {
        let handle = stream.try_clone().ok()?;
        let mut open = self.lock();
        if open.len() >= MAX_CONNECTIONS {
            // Only a client that is slow to send: one whose request is merely not parsed
            // yet (its thread not scheduled) is left to be answered.
            let stalled = open
                .iter()
                .enumerate()
                .filter(|(_, o)| o.state == ConnState::Reading && o.since.elapsed() >= STALLED)
                .min_by_key(|(_, o)| o.since)
                .map(|(i, _)| i);
            let victim = match stalled {
                Some(i) => Some(i),
                None => {
                    drop(open);
                    let (guard, i) = self.waiting_for_more(stream)?;
                    open = guard;
                    i
                }
            };
            if let Some(i) = victim {
                let victim = &mut open[i];
                victim.state = ConnState::Closed;
                // Its blocked read returns at once, and its thread leaves.
                let _ = victim.handle.shutdown(Close::Both);
                log::debug!("{name}: closed a connection that sent no whole request, to make room");
                open = match self
                    .freed
                    .wait_timeout_while(open, EVICT_WAIT, |o| o.len() >= MAX_CONNECTIONS)
                {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
            if open.len() >= MAX_CONNECTIONS {
                return None;
            }
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        open.push(Open {
            id,
            handle,
            since: Instant::now(),
            state: ConnState::Reading,
            waiting: false,
            started: false,
        });
        Some(id)
    }

    /// When every slot is young and `stream` has sent its whole request head within
    /// [`WHOLE_HEAD_WAIT`]: the connection to close for it, the oldest whose thread waits
    /// in a read with nothing unread on its socket (its request is not whole and no more of
    /// it has come) and that has sent part of a request or nothing for [`SILENT`] (one
    /// that has just connected may be a whole request on its way), returned with the lock
    /// held; no connection when a slot came free meanwhile. Looks again for
    /// [`EVICT_WAIT`], since a flood's threads may not have reached their read yet (so in
    /// a flood of whole requests a new one waits that long before its `503`). `None` when `stream` has not sent a whole head, or no
    /// connection waits so.
    fn waiting_for_more(&self, stream: &TcpStream) -> Option<(OpenGuard<'_>, Option<usize>)> {
        if !whole_head(stream, WHOLE_HEAD_WAIT) {
            return None;
        }
        let until = Instant::now() + EVICT_WAIT;
        loop {
            let open = self.lock();
            if open.len() < MAX_CONNECTIONS {
                return Some((open, None));
            }
            let victim = open
                .iter()
                .enumerate()
                .filter(|(_, o)| {
                    o.state == ConnState::Reading
                        && o.waiting
                        && (o.started || o.since.elapsed() >= SILENT)
                        && !unread(&o.handle)
                })
                .min_by_key(|(_, o)| o.since)
                .map(|(i, _)| i);
            if victim.is_some() {
                return Some((open, victim));
            }
            if Instant::now() >= until {
                return None;
            }
            drop(open);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its thread is about to wait in a read for (more of) its request, or is back;
    /// `started`: part of the request has come.
    fn waiting(&self, id: u64, waiting: bool, started: bool) {
        if let Some(o) = self.lock().iter_mut().find(|o| o.id == id) {
            o.waiting = waiting;
            o.started = started;
        }
    }

    /// The connection has its request: from now on it is not closed to make room.
    /// `false` if it was closed already.
    fn answering(&self, id: u64) -> bool {
        let mut open = self.lock();
        match open.iter_mut().find(|o| o.id == id) {
            Some(o) if o.state == ConnState::Reading => {
                o.state = ConnState::Answering;
                true
            }
            _ => false,
        }
    }

    fn leave(&self, id: u64) {
        self.lock().retain(|o| o.id != id);
        self.freed.notify_all();
    }

    /// At shutdown: every open connection's blocked read or write returns at once.
    fn close_all(&self) {
        for o in self.lock().iter_mut() {
            o.state = ConnState::Closed;
            let _ = o.handle.shutdown(Close::Both);
        }
    }
}

/// What is in `stream`'s receive buffer, up to `buf`'s length, without taking it and
/// without waiting; 0 when nothing is (or the peer closed).
fn peek_now(stream: &TcpStream, buf: &mut [u8]) -> usize {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is valid for writes of its length; MSG_PEEK leaves the data queued and
    // MSG_DONTWAIT makes this one call non-blocking without changing the socket's mode,
    // which its connection thread shares.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).unwrap_or(0)
}

/// Data has come on `stream` that nobody has read yet.
fn unread(stream: &TcpStream) -> bool {
    peek_now(stream, &mut [0u8; 1]) > 0
}

/// `stream` has sent a whole request head (up to its blank line) within `wait`.
fn whole_head(stream: &TcpStream, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    let mut buf = vec![0u8; MAX_HEAD];
    loop {
        let n = peek_now(stream, &mut buf);
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            return true;
        }
        if n == buf.len() || Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `503` at once for a connection no slot can take. Never blocks: whatever the client
/// sent already is read first (closing a socket with unread data resets it, and the
/// answer with it), the answer goes into the socket's buffer, and the connection closes.
fn refuse(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = stream.read(&mut [0u8; 4096]);
    let _ = Response::text(503, "busy: every connection is being answered; try again\n")
        .write_to(&mut stream, false);
    let _ = stream.shutdown(Close::Write);
}

/// Reads one request by `deadline`. `Err(Some(answer))` for a request that is malformed,
/// too large or incomplete at the deadline; `Err(None)` when there is nobody to answer (the
/// client sent nothing, or closed, or the connection was closed from outside).
/// `waiting` is told when a read waits for (more of) the request, and when it is back,
/// and whether part of the request has come.
fn read_request(
    stream: &mut TcpStream,
    deadline: Instant,
    waiting: &dyn Fn(bool, bool),
) -> Result<Request, Option<Response>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut head = httparse::Request::new(&mut headers);
        match head.parse(&buf) {
            Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => {
                let request = parse_head(&head)?;
                let body_len = content_length(&head)?;
                let mut body = buf.split_off(len);
                while body.len() < body_len {
                    let n = read_some(stream, &mut chunk, deadline, true, waiting)?;
                    body.extend_from_slice(&chunk[..n]);
                }
                body.truncate(body_len);
                return Ok(Request { body, ..request });
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(_) | Err(httparse::Error::TooManyHeaders) => {
                return Err(Some(Response::text(
                    431,
                    format!("request head over {MAX_HEAD} bytes or {MAX_HEADERS} headers\n"),
                )))
            }
            Err(e) => {
                return Err(Some(Response::text(
                    400,
                    format!("not an HTTP request: {e}\n"),
                )))
            }
        }
        let n = read_some(stream, &mut chunk, deadline, !buf.is_empty(), waiting)?;
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Method, path, query and content type of a complete head.
fn parse_head(head: &httparse::Request) -> Result<Request, Option<Response>> {
    let (Some(method), Some(target)) = (head.method, head.path) else {
        return Err(Some(Response::text(400, "not an HTTP request\n")));
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers: Vec<(String, String)> = head
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    let content_type = headers
        .iter()
        .find(|(n, _)| n == "content-type")
        .map(|(_, v)| v.clone());
    Ok(Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        content_type,
        headers,
        body: Vec::new(),
    })
}

/// The body's length from `Content-Length` (0 without one); chunked bodies are refused.
fn content_length(head: &httparse::Request) -> Result<usize, Option<Response>> {
    let header = |name: &str| {
        head.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
    };
    if header("transfer-encoding").is_some() {
        return Err(Some(Response::text(
            501,
            "request bodies must come with Content-Length\n",
        )));
    }
    match header("content-length").map(|v| v.parse::<usize>()) {
        None => Ok(0),
        Some(Ok(n)) if n <= MAX_BODY => Ok(n),
        Some(Ok(n)) => Err(Some(Response::text(
            413,
            format!("request body of {n} bytes, limit {MAX_BODY}\n"),
        ))),
        Some(Err(_)) => Err(Some(Response::text(400, "bad Content-Length\n"))),
    }
}

/// One read, given the time left until `deadline`. `started`: the client has sent part of
/// a request, so running out of time is a `408`; otherwise the connection just closes.
fn read_some(
    stream: &mut TcpStream,
    chunk: &mut [u8],
    deadline: Instant,
    started: bool,
    waiting: &dyn Fn(bool, bool),
) -> Result<usize, Option<Response>> {
    let late = || {
        started.then(|| {
            Response::text(
                408,
                format!(
                    "the request did not arrive within {}s\n",
                    REQUEST_DEADLINE.as_secs_f64()
                ),
            )
        })
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        let _ = stream.set_read_timeout(Some(left));
        waiting(true, started);
        let read = stream.read(chunk);
        waiting(false, true);
        match read {
            Ok(0) => return Err(None),
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(late())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(None),
        }
    }
}
