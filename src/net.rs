//! Serving connections: HTTP/1.1 with upgrades (and nothing else: a cleartext HTTP/2 preface
//! is an HTTP/1.1 parse error), a header-read timeout against slow clients, and sockets that
//! close themselves when their peer stops reading.
//!
//! A watcher whose socket takes no bytes for the drain timeout while the gateway has bytes for
//! it is cut off: its write fails, the server drops the connection and with it the watcher's
//! hold on replay buffers. The client comes back with its cursor.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::Response;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::live::{Cancelled, Handoff, Live, Session};
use crate::metrics::Metrics;

mod http1;
mod socket;
mod websocket;

/// Limits every connection of a listener lives under.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// A socket that takes no bytes this long while the server has bytes for it is closed.
    pub drain_timeout: Duration,
    /// A request head must arrive complete within this long (slow-header clients).
    pub header_read_timeout: Duration,
    /// The longest request head, in bytes (431 past it; hyper's floor is 8 KiB).
    pub max_head_bytes: usize,
    /// Most header lines a request may have (431 past it).
    pub max_headers: usize,
    /// The largest request body the gateway reads itself (a larger one is hyper's, whose
    /// handler answers 413).
    pub max_body_bytes: usize,
    /// A request body read by the gateway must arrive complete within this long after its head.
    pub body_read_timeout: Duration,
}

/// Places for connections, shared by the listeners (`--max-connections`).
#[derive(Clone)]
pub struct ConnectionSlots {
    slots: Arc<tokio::sync::Semaphore>,
    max: usize,
}

impl ConnectionSlots {
    pub fn new(max: usize) -> ConnectionSlots {
        ConnectionSlots { slots: Arc::new(tokio::sync::Semaphore::new(max)), max }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    /// Resolves once every connection has closed (on either listener).
    async fn all_closed(&self) {
        // `max` fits: `Config::max_connections` keeps it within u32.
        let _all = self.slots.acquire_many(self.max as u32).await;
    }
}

/// Serves `router` on `listener` over HTTP/1.1 (with upgrades, for WebSockets) until `drained` is
/// cancelled; then stops accepting, lets each connection finish its request in flight, and
/// returns when every connection has closed. A connection is accepted only with one of
/// `slots`; `metrics` counts the requests refused before they reach the router.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    slots: ConnectionSlots,
    metrics: Arc<Metrics>,
    drained: CancellationToken,
) {
    let mut paused = Paused::default();
    loop {
        let (stream, _addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little instead of spinning.
                    if let Some(failures) = paused.paused() {
                        tracing::warn!(error = %e, failures, "accept failed: new connections wait in the listen queue");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = drained.cancelled() => break,
        };
        // At the cap this connection waits for a place, and the next ones in the listen queue,
        // as when descriptors run out, but with descriptors and memory left for the database,
        // the upstreams and agent programs.
        let slot = match slots.slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if let Some(times) = paused.paused() {
                    tracing::warn!(
                        max = slots.max,
                        times,
                        "at --max-connections: new connections wait in the listen queue"
                    );
                }
                tokio::select! {
                    slot = slots.slots.clone().acquire_owned() => slot.expect("the slots are never closed"),
                    _ = drained.cancelled() => break,
                }
            }
        };
        paused.ended();
        let _ = stream.set_nodelay(true);
        // The slot is the task's only sign of life (another would grow every connection's
        // task, idle watchers' too): given back when the connection ends, or passed on to a
        // WebSocket session hyper upgrades it to, which runs in a task of its own (awaited
        // here, it would grow this task, idle watchers' too).
        let stream = Arc::new(socket::Connection::new(stream));
        let router = router.clone();
        let metrics = metrics.clone();
        let mut drained = Cancelled::new(&drained);
        // The connection's life: bodyless GETs first (read and answered by `http1`), then
        // hyper from any other request on. A block, not an async fn: a function's arguments
        // take room of their own in its state, in every connection's task (idle watchers' too:
        // W4's memory per stream rose 0.13 KiB with one, BENCHMARKS.md "Before and after").
        tokio::spawn(async move {
            let next = http1::serve(&stream, &router, &limits, &metrics, &mut drained).await;
            // The streams that lent the socket to the hub's rounds have let it go.
            let Ok(stream) = Arc::try_unwrap(stream) else {
                tracing::error!("a connection's socket is still lent out after its streams ended; closing it");
                return;
            };
            let mut stream = stream.into_inner();
            match next {
                http1::Next::Hyper(prefix) => with_hyper(stream, prefix, router, limits, drained, slot).await,
                http1::Next::Closed => {
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                }
                http1::Next::Linger => {
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                    linger(&stream).await;
                }
            }
        });
    }
    drop(listener);
    slots.all_closed().await;
}

/// The rest of a connection served by hyper, `prefix` being what `http1` read of its next
/// request; shut down gracefully once the gateway drains.
async fn with_hyper(
    stream: TcpStream,
    prefix: Vec<u8>,
    router: Router,
    limits: ConnectionLimits,
    mut drained: Cancelled,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    let drain = limits.drain_timeout;
    let inner = GuardedStream { inner: stream, drain_timeout: drain, stalled: None };
    let io = TokioIo::new(Rewind { prefix, read: 0, inner });
    // The slot goes with hyper's service, unless a session took it.
    let slot = Arc::new(std::sync::Mutex::new(Some(slot)));
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        let router = router.clone();
        let slot = slot.clone();
        async move {
            let upgrade = request.extensions_mut().remove::<OnUpgrade>();
            let response = match router.oneshot(request.map(Body::new)).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(hand_over(response, upgrade, &slot, drain))
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_head_bytes)
        .max_headers(limits.max_headers)
        .keep_alive(true)
        .serve_connection(io, service)
        .with_upgrades();
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        tokio::select! {
            biased;
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::trace!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = &mut drained, if !draining => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// After the gateway has closed its side of a connection whose last request's body it left
/// unread (refused from the head): reads and drops what the client still sends, for a moment
/// and a bounded amount, until the client closes too. Closing a socket with unread bytes resets it, and a reset can reach the client
/// before the answer it was sent.
async fn linger(stream: &TcpStream) {
    const MOST: usize = 4 * 1024 * 1024;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut dropped = 0;
    let mut scratch = [0u8; 4096];
    while dropped < MOST {
        match stream.try_read(&mut scratch) {
            Ok(0) => return,
            Ok(n) => dropped += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if tokio::time::timeout_at(deadline, stream.readable()).await.is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

/// A pause in accepting (out of file descriptors, or at --max-connections), logged when it
/// starts, every ten seconds while it goes on, and when it ends: a line per failed attempt,
/// every 50 ms, was twenty lines a second for as long as the gateway was full.
#[derive(Default)]
struct Paused {
    since: Option<std::time::Instant>,
    logged: Option<std::time::Instant>,
    count: u64,
}

impl Paused {
    const EVERY: Duration = Duration::from_secs(10);

    /// One more time accepting waits; how many so far when a line is due.
    fn paused(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        self.count += 1;
        self.since.get_or_insert(now);
        let due = self.logged.is_none_or(|at| now.duration_since(at) >= Self::EVERY);
        due.then(|| {
            self.logged = Some(now);
            self.count
        })
    }

    fn ended(&mut self) {
        if let Some(since) = self.since {
            tracing::info!(times = self.count, seconds = since.elapsed().as_secs_f64(), "accepting connections again");
            *self = Paused::default();
        }
    }
}

/// A response with a live stream, as hyper serves it: a watch becomes the body; a session is
/// served on the socket once hyper has written the `101` and handed the socket back, holding
/// the connection's slot (`--max-connections`) until it ends.
fn hand_over(
    mut response: Response,
    upgrade: Option<OnUpgrade>,
    slot: &std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>,
    drain: Duration,
) -> Response {
    match Handoff::take(response.extensions()) {
        Some(Live::Watch(watch)) => {
            response.headers_mut().remove(axum::http::header::CONTENT_LENGTH);
            *response.body_mut() = Body::from_stream(watch.into_body());
        }
        Some(Live::Session(session)) => match upgrade {
            Some(upgrade) if response.status() == StatusCode::SWITCHING_PROTOCOLS => {
                let slot = slot.lock().expect("never poisoned").take();
                tokio::spawn(async move {
                    serve_upgraded(upgrade, *session, drain).await;
                    drop(slot);
                });
            }
            _ => tracing::error!("a WebSocket session was opened on a request hyper cannot upgrade"),
        },
        None => {}
    }
    response
}

/// Serves a WebSocket session on a connection hyper was serving, once hyper has written the
/// `101` and handed the socket back (with what it had read past the upgrade request).
async fn serve_upgraded(upgrade: OnUpgrade, session: Session, drain: Duration) {
    let Ok(upgraded) = upgrade.await else { return };
    let Ok(parts) = upgraded.downcast::<TokioIo<Rewind>>() else {
        tracing::error!("an upgraded connection is not one of the gateway's sockets");
        return;
    };
    let Rewind { mut prefix, read, inner } = parts.io.into_inner();
    prefix.drain(..read);
    prefix.extend_from_slice(&parts.read_buf);
    websocket::serve(&Arc::new(socket::Connection::new(inner.inner)), session, prefix, drain).await;
}

/// A stream that first yields bytes already read from it.
struct Rewind {
    prefix: Vec<u8>,
    read: usize,
    inner: GuardedStream,
}

impl AsyncRead for Rewind {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.read < this.prefix.len() {
            let n = buf.remaining().min(this.prefix.len() - this.read);
            buf.put_slice(&this.prefix[this.read..this.read + n]);
            this.read += n;
            if this.read == this.prefix.len() {
                this.prefix = Vec::new();
                this.read = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A TCP stream whose writes fail once they have been blocked for the drain timeout.
pub struct GuardedStream {
    inner: TcpStream,
    drain_timeout: Duration,
    /// Armed when a write first finds the socket full; cleared by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl GuardedStream {
    /// Whether the armed stall timer has run out (polling it registers the task's waker).
    fn stall_expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.stalled.as_mut().is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready())
    }

    /// Only bytes actually written count as progress; flushes and empty writes do not.
    fn guard_write(&mut self, cx: &mut Context<'_>, result: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match result {
            Poll::Ready(Ok(n)) if n > 0 => {
                self.stalled = None;
                Poll::Ready(Ok(n))
            }
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                let timeout = self.drain_timeout;
                self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if self.stall_expired(cx) {
                    return Poll::Ready(Err(stalled_error()));
                }
                Poll::Pending
            }
        }
    }
}

fn stalled_error() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the peer stopped reading")
}

impl AsyncRead for GuardedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.guard_write(cx, result)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.guard_write(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A TCP flush is always immediate; it must not reset a stalled write's timer.
        if self.stall_expired(cx) {
            return Poll::Ready(Err(stalled_error()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
