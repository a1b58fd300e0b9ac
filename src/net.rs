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

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

mod direct;
pub mod websocket;

/// Limits every connection of a listener lives under.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// A socket that takes no bytes this long while the server has bytes for it is closed.
    pub drain_timeout: Duration,
    /// A request head must arrive complete within this long (slow-header clients).
    pub header_read_timeout: Duration,
}

/// Serves `router` on `listener` over HTTP/1.1 (with upgrades, for WebSockets) until `stop` is
/// cancelled; then stops accepting, lets each connection finish its request in flight, and
/// returns when every connection has closed.
pub async fn serve(listener: TcpListener, router: Router, limits: ConnectionLimits, stop: CancellationToken) {
    // Every connection task holds a receiver; `closed()` resolves when the last one is gone.
    let (all_closed, connection_alive) = watch::channel(());
    loop {
        let (stream, _addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let mut stopped = Cancelled::new(&stop);
        let alive = connection_alive.clone();
        tokio::spawn(async move {
            // Live streams first (written by `direct`); hyper takes over at any other request.
            let prefix = match direct::serve(&stream, &router, &limits, &mut stopped).await {
                direct::Next::Hyper(prefix) => prefix,
                direct::Next::Closed => {
                    let mut stream = stream;
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                    drop(alive);
                    return;
                }
            };
            let inner = GuardedStream { inner: stream, drain_timeout: limits.drain_timeout, stalled: None };
            let io = TokioIo::new(Rewind { prefix, read: 0, inner });
            let service = TowerToHyperService::new(router);
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(direct::MAX_REQUEST_HEAD)
                .max_headers(direct::MAX_HEADERS)
                .keep_alive(true)
                .serve_connection(io, service)
                .with_upgrades();
            tokio::pin!(connection);
            let mut stopping = false;
            loop {
                tokio::select! {
                    biased;
                    result = connection.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = &mut stopped, if !stopping => {
                        stopping = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(alive);
        });
    }
    drop(listener);
    drop(connection_alive);
    all_closed.closed().await;
}

/// Serves a WebSocket session on a connection hyper was serving, once hyper has written the
/// `101` and handed the socket back (with what it had read past the upgrade request).
pub async fn serve_upgraded(upgrade: hyper::upgrade::OnUpgrade, session: crate::http::ws::OwnedSession) {
    let Ok(upgraded) = upgrade.await else { return };
    let Ok(parts) = upgraded.downcast::<TokioIo<Rewind>>() else {
        tracing::error!("an upgraded connection is not one of the gateway's sockets");
        return;
    };
    let Rewind { mut prefix, read, inner } = parts.io.into_inner();
    prefix.drain(..read);
    prefix.extend_from_slice(&parts.read_buf);
    let drain = inner.drain_timeout;
    websocket::serve(&inner.inner, session, prefix, drain).await;
}

/// Resolves when a token is cancelled, for futures polled on every wake of a busy task (a
/// connection, a live stream): polling the token's own future takes a lock each time, so it is
/// polled only after it has woken the task itself, which it does through a waker that raises a
/// flag on the way. Every other poll is an atomic swap.
pub struct Cancelled {
    wait: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    flag: std::sync::Arc<FlagWaker>,
    waker: std::task::Waker,
    polled: bool,
}

/// Raises `fired`, then wakes the task last registered.
struct FlagWaker {
    fired: std::sync::atomic::AtomicBool,
    task: futures_util::task::AtomicWaker,
}

impl std::task::Wake for FlagWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.fired.store(true, std::sync::atomic::Ordering::Release);
        self.task.wake();
    }
}

impl Cancelled {
    pub fn new(token: &CancellationToken) -> Cancelled {
        let flag = std::sync::Arc::new(FlagWaker { fired: false.into(), task: Default::default() });
        let waker = std::task::Waker::from(flag.clone());
        Cancelled { wait: Box::pin(token.clone().cancelled_owned()), flag, waker, polled: false }
    }
}

impl Future for Cancelled {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        this.flag.task.register(cx.waker());
        if this.polled && !this.flag.fired.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Pending;
        }
        this.polled = true;
        this.flag.fired.store(false, std::sync::atomic::Ordering::Relaxed);
        let ready = this.wait.as_mut().poll(&mut Context::from_waker(&this.waker));
        if ready.is_ready() {
            // Cancelled for good: every later poll is ready too.
            this.flag.fired.store(true, std::sync::atomic::Ordering::Release);
        }
        ready
    }
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
