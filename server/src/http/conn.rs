//! Connections: the accept loop under a connection limit, per-connection timeouts (request
//! headers, idle keep-alive), in-flight tracking for drains, and half-closed clients.
//!
//! Over the limit, a new connection is still accepted (so the listen backlog never fills):
//! it is served once without keep-alive, `/health` answering as usual and every other path
//! 503 with Retry-After, and one idle connection is asked to close to make room (as nginx
//! reuses idle keep-alive connections when it runs out). Past a small reserve of such
//! connections, new ones are closed at once.

use super::errors::ApiError;
use super::AppState;
use axum::body::{Body, Bytes, HttpBody};
use axum::response::Response;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use std::convert::Infallible;
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

/// Connection settings of `tessera serve`.
#[derive(Clone, Debug)]
pub struct ConnOptions {
    /// Most connections served at once (more are answered 503, see the module docs).
    pub max_connections: usize,
    /// A request's headers must be complete this long after the connection opened or its
    /// previous response was sent; its body must then arrive within as long again.
    pub header_read_timeout: Duration,
    /// A connection with no request in progress and nothing received for this long is closed.
    pub keep_alive_timeout: Duration,
}

/// Where the server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Serving normally.
    Serving,
    /// Shutting down: idle connections are closed, busy ones close after their response,
    /// new ones are served once (health 503, generation 503).
    Draining,
    /// Every connection is closed and the listener with them.
    Closed,
}

/// Over-limit connections served at once (beyond them, new connections are closed at once).
const OVERFLOW_RESERVE: usize = 32;
/// How long an over-limit connection may take to send its request and read the answer.
const OVERFLOW_TIMEOUT: Duration = Duration::from_secs(2);
/// Least time between two "connection limit reached" or accept-error log lines.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The server's connection and request metrics (in the engine's registry, so `/metrics` has them).
pub struct ServerMetrics {
    /// Connections open (over-limit ones excluded).
    pub open: IntGauge,
    /// Connections refused (answered 503 or closed at once) because the limit was reached.
    pub refused: IntCounter,
    /// Idle connections closed to make room for new ones at the limit.
    pub reclaimed: IntCounter,
    /// Connections closed by a timeout, by which (`header_read`, `keep_alive`).
    pub conn_timeouts: IntCounterVec,
    /// Requests answered 408 because they ran past their deadline or their body came too slowly.
    pub request_timeouts: IntCounter,
}

impl ServerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let open = IntGauge::new("tessera_http_connections_open", "HTTP connections open (over-limit connections excluded).")?;
        let refused = IntCounter::new(
            "tessera_http_connections_refused_total",
            "Connections accepted over --max-connections and answered 503 (health excepted) or closed at once.",
        )?;
        let reclaimed =
            IntCounter::new("tessera_http_connections_reclaimed_total", "Idle connections closed to make room at the connection limit.")?;
        let conn_timeouts = IntCounterVec::new(
            Opts::new("tessera_http_connection_timeouts_total", "Connections closed by a timeout (header_read, keep_alive)."),
            &["timeout"],
        )?;
        let request_timeouts = IntCounter::new(
            "tessera_request_timeouts_total",
            "Requests answered 408: past their deadline (request_timeout) or their body arrived too slowly.",
        )?;
        registry.register(Box::new(open.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(reclaimed.clone()))?;
        registry.register(Box::new(conn_timeouts.clone()))?;
        registry.register(Box::new(request_timeouts.clone()))?;
        for t in ["header_read", "keep_alive"] {
            conn_timeouts.with_label_values(&[t]);
        }
        Ok(ServerMetrics { open, refused, reclaimed, conn_timeouts, request_timeouts })
    }
}

/// What all connections share: counts, the in-flight total (drains wait for it to reach 0)
/// and the signal asking an idle connection to make room.
pub struct Tracker {
    open: AtomicUsize,
    overflow: AtomicUsize,
    inflight: watch::Sender<usize>,
    /// Wakes every connection to see whether it is idle and may be closed to make room.
    reclaim: Notify,
    /// Set when a connection over the limit asked for room; the first idle connection that
    /// sees it clears it and closes.
    reclaim_wanted: AtomicBool,
    last_limit_log: Mutex<Option<Instant>>,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            open: AtomicUsize::new(0),
            overflow: AtomicUsize::new(0),
            inflight: watch::channel(0).0,
            reclaim: Notify::new(),
            reclaim_wanted: AtomicBool::new(false),
            last_limit_log: Mutex::new(None),
        }
    }
}

impl Tracker {
    /// Waits until no request is in progress on any connection.
    pub async fn idle(&self) {
        let mut rx = self.inflight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Takes the standing request for room (at most one connection closes per request).
    fn take_reclaim(&self) -> bool {
        self.reclaim_wanted.load(Ordering::Acquire) && self.reclaim_wanted.swap(false, Ordering::AcqRel)
    }

    /// Whether `LOG_EVERY` has passed since the last limit log line (and if so, starts anew).
    fn log_due(&self) -> bool {
        let mut last = self.last_limit_log.lock().unwrap_or_else(|e| e.into_inner());
        let due = !matches!(*last, Some(t) if t.elapsed() < LOG_EVERY);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

/// One connection's activity: requests in progress, whether the next request has begun to
/// arrive, and when it last received bytes or started or finished a request (for the
/// keep-alive timeout).
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
    inflight: AtomicUsize,
    /// Bytes of a request whose headers are not all in yet have arrived.
    partial: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity { base: Instant::now(), last_ms: AtomicU64::new(0), inflight: AtomicUsize::new(0), partial: AtomicBool::new(false) }
    }

    fn touch(&self) {
        self.last_ms.store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    fn busy(&self) -> bool {
        self.inflight.load(Ordering::Acquire) > 0
    }

    /// Nothing in progress and nothing of a next request received: safe to close.
    fn idle(&self) -> bool {
        !self.busy() && !self.partial.load(Ordering::Acquire)
    }

    /// When the keep-alive timer should next look at the connection (at `now`): `timeout` after
    /// the last activity, or, while a request is in progress (the timeout does not apply), a
    /// whole `timeout` from now. A busy connection's last activity can be long past (a response
    /// streaming for longer than the timeout touches nothing), and a deadline there would fire
    /// at once, again and again: the connection's task spun on a runtime thread for the rest
    /// of every long response, taking CPU from the model (a quarter of a 2-core host's samples
    /// under eight streams).
    fn keep_alive_check(&self, timeout: Duration, now: Instant) -> Instant {
        if self.busy() { now + timeout } else { self.last() + timeout }
    }
}

/// A request in progress, from its headers until its response body is dropped (sent or not).
struct InFlight {
    conn: Arc<Activity>,
    state: Arc<AppState>,
}

impl InFlight {
    fn new(conn: Arc<Activity>, state: Arc<AppState>) -> Self {
        conn.inflight.fetch_add(1, Ordering::AcqRel);
        conn.partial.store(false, Ordering::Release);
        conn.touch();
        state.tracker.inflight.send_modify(|n| *n += 1);
        InFlight { conn, state }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.touch();
        self.conn.inflight.fetch_sub(1, Ordering::AcqRel);
        self.state.tracker.inflight.send_modify(|n| *n -= 1);
    }
}

/// A response body that keeps its request counted as in flight until it is dropped.
struct TrackedBody {
    body: Body,
    _inflight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The client's socket, in every request's extensions, to notice a client that closed its
/// side while its answer is being computed.
#[derive(Clone)]
pub struct PeerSocket(Arc<TcpStream>);

impl PeerSocket {
    /// Resolves once the client has closed its sending side (EOF) or the connection failed.
    /// A client that half-closes (`shutdown(SHUT_WR)`) and one that went away look the same
    /// here; with more bytes waiting (a pipelined request) it never resolves.
    pub async fn closed(&self) {
        let mut byte = [0u8; 1];
        match self.0.peek(&mut byte).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }
}

/// The TCP stream shared between hyper (reading and writing) and [`PeerSocket`] (peeking).
struct SharedStream {
    tcp: Arc<TcpStream>,
    activity: Arc<Activity>,
}

impl AsyncRead for SharedStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.tcp.poll_read_ready(cx))?;
            match self.tcp.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    if n > 0 {
                        self.activity.touch();
                        if !self.activity.busy() {
                            self.activity.partial.store(true, Ordering::Release);
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match self.tcp.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match self.tcp.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown(2) on a descriptor this Arc keeps open.
        let r = unsafe { libc::shutdown(self.tcp.as_raw_fd(), libc::SHUT_WR) };
        Poll::Ready(if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) })
    }
}

/// Raises the soft open-file limit (RLIMIT_NOFILE) to the hard limit and logs it; returns the
/// soft limit in effect.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "reading the open-file limit failed");
        return 1024;
    }
    let old = lim.rlim_cur;
    // An infinite hard limit is refused for RLIMIT_NOFILE: use the kernel's ceiling then.
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open").ok().and_then(|s| s.trim().parse::<u64>().ok());
    let target = if lim.rlim_max == libc::RLIM_INFINITY { nr_open.unwrap_or(old) } else { lim.rlim_max };
    if target > old {
        let raised = libc::rlimit { rlim_cur: target, rlim_max: lim.rlim_max };
        // SAFETY: setrlimit reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::info!(from = old, to = target, "raised the open-file soft limit to the hard limit");
            return target;
        }
        tracing::warn!(soft = old, hard = target, error = %std::io::Error::last_os_error(), "raising the open-file soft limit failed");
    } else {
        tracing::info!(soft = old, hard = lim.rlim_max, "open-file limit");
    }
    old
}

/// Binds `host:port` and listens with a backlog of `max_connections` (at least 1024; the
/// kernel caps it at `net.core.somaxconn`). Tokio's default backlog (1024) overflows when a
/// load test opens a thousand connections at once, and with SYN cookies an overflowed
/// connection that is already sending is reset: the queue must hold a burst as large as the
/// connection limit.
pub async fn listen(host: &str, port: u16, max_connections: usize) -> io::Result<TcpListener> {
    let backlog = u32::try_from(max_connections.clamp(1024, 65535)).unwrap_or(65535);
    let mut last_error = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(addr).and_then(|()| socket.listen(backlog)) {
            Ok(listener) => {
                if let Some(cap) = std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok().and_then(|s| s.trim().parse::<u32>().ok()) {
                    if cap < backlog {
                        tracing::info!(backlog, somaxconn = cap, "the listen backlog is capped by net.core.somaxconn");
                    }
                }
                return Ok(listener);
            }
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{host} resolves to no address"))))
}

/// Accepts connections until the phase becomes [`Phase::Closed`] (the listener closes then).
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    overflow: Router,
    state: Arc<AppState>,
    opts: ConnOptions,
    phase: watch::Receiver<Phase>,
) {
    let mut last_error_log: Option<Instant> = None;
    loop {
        let mut closed = phase.clone();
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = closed.wait_for(|p| *p == Phase::Closed) => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Typically EMFILE/ENFILE: out of descriptors. Pause instead of spinning.
                if !matches!(last_error_log, Some(t) if t.elapsed() < LOG_EVERY) {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    last_error_log = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let tracker = &state.tracker;
        if tracker.open.load(Ordering::Acquire) >= opts.max_connections {
            state.metrics.refused.inc();
            tracker.reclaim_wanted.store(true, Ordering::Release);
            tracker.reclaim.notify_waiters();
            if tracker.log_due() {
                tracing::warn!(
                    max_connections = opts.max_connections,
                    refused_total = state.metrics.refused.get(),
                    "connection limit reached: new connections get 503 (health excepted) and idle ones are closed"
                );
            }
            if tracker.overflow.fetch_add(1, Ordering::AcqRel) < OVERFLOW_RESERVE {
                let (overflow, state) = (overflow.clone(), state.clone());
                tokio::spawn(async move {
                    serve_overflow(tcp, overflow).await;
                    state.tracker.overflow.fetch_sub(1, Ordering::AcqRel);
                });
            } else {
                tracker.overflow.fetch_sub(1, Ordering::AcqRel);
                drop(tcp);
            }
            continue;
        }
        tracker.open.fetch_add(1, Ordering::AcqRel);
        state.metrics.open.inc();
        let (app, state, opts, phase) = (app.clone(), state.clone(), opts.clone(), phase.clone());
        tokio::spawn(async move {
            serve_connection(tcp, app, state.clone(), opts, phase).await;
            state.tracker.open.fetch_sub(1, Ordering::AcqRel);
            // Room was made: a standing request for it is answered.
            state.tracker.reclaim_wanted.store(false, Ordering::Release);
            state.metrics.open.dec();
        });
    }
}

/// An over-limit connection: one request, no keep-alive, a short time limit.
async fn serve_overflow(tcp: TcpStream, app: Router) {
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| app.clone().oneshot(req.map(Body::new)));
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(OVERFLOW_TIMEOUT).keep_alive(false);
    let _ = tokio::time::timeout(OVERFLOW_TIMEOUT * 2, builder.serve_connection(TokioIo::new(tcp), svc)).await;
}

/// The routes over-limit connections get: `/health` as usual, 503 for everything else.
pub fn overflow_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", axum::routing::get(super::ops::health))
        .fallback(|| async { ApiError::too_many_connections() })
        .with_state(state)
}

/// Serves one connection until the client closes it, a timeout closes it, or the drain does.
async fn serve_connection(tcp: TcpStream, app: Router, state: Arc<AppState>, opts: ConnOptions, mut phase: watch::Receiver<Phase>) {
    let tcp = Arc::new(tcp);
    let activity = Arc::new(Activity::new());
    let serving = *phase.borrow_and_update() == Phase::Serving;
    let peer = PeerSocket(tcp.clone());
    let svc = {
        let (activity, state) = (activity.clone(), state.clone());
        hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            let inflight = InFlight::new(activity.clone(), state.clone());
            req.extensions_mut().insert(peer.clone());
            let app = app.clone();
            async move {
                let resp: Response = app.oneshot(req.map(Body::new)).await.unwrap_or_else(|e: Infallible| match e {});
                Ok::<_, Infallible>(resp.map(|body| Body::new(TrackedBody { body, _inflight: inflight })))
            }
        })
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_read_timeout)
        // A client may shut down its sending side and still read the answer.
        .half_close(true)
        .keep_alive(serving);
    let io = SharedStream { tcp, activity: activity.clone() };
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let mut draining = !serving;
    loop {
        let idle_deadline = activity.keep_alive_check(opts.keep_alive_timeout, Instant::now());
        // Created before the check below, so a request for room made in between still wakes it.
        let reclaim = state.tracker.reclaim.notified();
        if activity.idle() && state.tracker.take_reclaim() {
            state.metrics.reclaimed.inc();
            break;
        }
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    if e.is_timeout() {
                        state.metrics.conn_timeouts.with_label_values(&["header_read"]).inc();
                        tracing::debug!("closing a connection: its request headers did not arrive in time");
                    } else {
                        tracing::debug!(error = %e, "connection error");
                    }
                }
                break;
            }
            () = tokio::time::sleep_until(idle_deadline.into()) => {
                if !activity.busy() && activity.last() + opts.keep_alive_timeout <= Instant::now() {
                    state.metrics.conn_timeouts.with_label_values(&["keep_alive"]).inc();
                    break;
                }
            }
            // Woken to look again at the top of the loop: only a connection with nothing in
            // progress or arriving may close (one sending a request would be reset mid-request).
            () = reclaim => {}
            changed = phase.changed() => {
                let p = if changed.is_err() { Phase::Closed } else { *phase.borrow_and_update() };
                match p {
                    Phase::Closed => break,
                    // Idle, or half a request: close now. Busy: close after the response.
                    Phase::Draining if !draining => {
                        draining = true;
                        if !activity.busy() {
                            break;
                        }
                        conn.as_mut().graceful_shutdown();
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// The keep-alive timer of a connection whose request is in progress, however long ago its
    /// last activity, looks again a whole timeout later rather than at once (it used to fire
    /// immediately, over and over, while a long response streamed); an idle connection's
    /// deadline is its last activity plus the timeout.
    #[test]
    fn keep_alive_timer_waits_while_a_request_is_in_progress() {
        let a = Activity::new();
        let timeout = Duration::from_millis(50);
        let later = a.base + Duration::from_secs(60);
        assert_eq!(a.keep_alive_check(timeout, later), a.last() + timeout, "idle: from the last activity");
        a.inflight.fetch_add(1, Ordering::AcqRel);
        assert_eq!(a.keep_alive_check(timeout, later), later + timeout, "busy: a timeout from now");
        a.inflight.fetch_sub(1, Ordering::AcqRel);
        assert!(a.keep_alive_check(timeout, later) < later, "idle again: due");
    }

    /// A burst of 1,100 connections that start sending before the server accepts any: none
    /// is reset (with tokio's default backlog of 1024, the overflow was, under SYN cookies).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_listen_backlog_holds_a_burst_of_connections() {
        // Past tokio's default backlog (1024), as far as the kernel's cap on backlogs allows.
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn").unwrap().trim().parse().unwrap();
        let burst = 1100.min(somaxconn.saturating_sub(16));
        if burst < 1100 {
            eprintln!("net.core.somaxconn is {somaxconn}: a burst of {burst} only, within tokio's default backlog");
        }
        assert!(raise_fd_limit() > 2 * burst as u64 + 64, "the open-file limit is too low for the burst");
        let listener = listen("127.0.0.1", 0, 4096).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let clients: Vec<_> = (0..burst)
            .map(|_| {
                tokio::spawn(async move {
                    let mut s = TcpStream::connect(addr).await?;
                    for _ in 0..5 {
                        s.write_all(b"GET /health HTTP/1.1\r\n").await?;
                        tokio::time::sleep(Duration::from_millis(40)).await;
                    }
                    Ok::<_, io::Error>(s)
                })
            })
            .collect();
        let mut held = Vec::new();
        for c in clients {
            held.push(c.await.unwrap().expect("a queued connection was reset"));
        }
        // All of them are in the queue, whole.
        for _ in 0..burst {
            let (mut s, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.unwrap().unwrap();
            let mut buf = [0u8; 22 * 5];
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut buf).await.unwrap();
        }
    }
}
