//! Serving connections: HTTP/1.1 with upgrades, a header-read timeout against slow clients,
//! and sockets that close themselves when their peer stops reading.
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
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

/// Bytes hyper may hold per connection, reading or writing.
const CONNECTION_BUFFER: usize = 64 * 1024;

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
        let io = TokioIo::new(GuardedStream { inner: stream, drain_timeout: limits.drain_timeout, stalled: None });
        let service = TowerToHyperService::new(router.clone());
        let stop = stop.clone();
        let alive = connection_alive.clone();
        tokio::spawn(async move {
            let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
            // A small write buffer: a watcher that lags keeps its backlog in the shared replay
            // buffer (which it reads from later) instead of a private copy per connection.
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(true)
                .max_buf_size(CONNECTION_BUFFER);
            let connection = builder.serve_connection_with_upgrades(io, service);
            tokio::pin!(connection);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = stop.cancelled(), if !stopping => {
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

/// A TCP stream whose writes fail once they have been blocked for the drain timeout.
pub struct GuardedStream {
    inner: TcpStream,
    drain_timeout: Duration,
    /// Armed when a write first finds the socket full; cleared by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl GuardedStream {
    fn guard<T>(&mut self, cx: &mut Context<'_>, result: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let timeout = self.drain_timeout;
                let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if sleep.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stopped reading")));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.guard(cx, result)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.guard(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.inner).poll_flush(cx);
        self.guard(cx, result)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
