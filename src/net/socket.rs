//! The socket primitives both live transports write with (`http1.rs` for watches,
//! `websocket.rs` for sessions): a whole vectored write bounded by the drain timeout, the hub's
//! [`Socket`] over a client's [`Connection`] (the one `unsafe` write), and [`Parking`], a stream lent to
//! the rounds of the turn it reads.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::stalled_error;
use crate::encoding::Transport;
use crate::hub::{Cursor, ParkedStream, Socket, TurnBuffer, Unparked};
use crate::metrics::Metrics;

/// Writes every byte of `parts`, failing once the socket has taken nothing for `drain`.
pub(super) async fn write_all(stream: &TcpStream, mut parts: &mut [IoSlice<'_>], drain: Duration) -> io::Result<()> {
    let mut blocked_since: Option<Instant> = None;
    while !parts.is_empty() {
        match stream.try_write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                blocked_since = None;
                IoSlice::advance_slices(&mut parts, n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let deadline = *blocked_since.get_or_insert_with(Instant::now) + drain;
                match tokio::time::timeout_at(deadline, stream.writable()).await {
                    Ok(ready) => ready?,
                    Err(_) => return Err(stalled_error()),
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A client's connection, as the live transports share it: tokio's stream (which it derefs
/// to), and the hub's [`Socket`] that rounds write to while a stream is parked. Shared in an
/// `Arc` that is lent to the rounds as it is: no allocation of its own per stream.
pub struct Connection(TcpStream);

impl Connection {
    pub(super) fn new(stream: TcpStream) -> Connection {
        Connection(stream)
    }

    pub(super) fn into_inner(self) -> TcpStream {
        self.0
    }
}

impl std::ops::Deref for Connection {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        &self.0
    }
}

impl Socket for Connection {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        // A plain write(2) on the descriptor. tokio's `try_write*` first reads the socket's
        // readiness, a word the reactor thread updates on every ACK: in a round over a thousand
        // sockets that cache miss each was the gateway's costliest user-space line (W2). A
        // WouldBlock left unseen by tokio costs one extra attempt when the stream's task next
        // writes. (write, not send: the kernel's write count, /proc/PID/io `syscw`, sees it.)
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor belongs to `self`, open while it is borrowed; write(2) reads
        // at most `bytes.len()` bytes from `bytes`.
        let written = unsafe { libc::write(self.0.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        if written < 0 { Err(io::Error::last_os_error()) } else { Ok(written as usize) }
    }
}

/// A stream's [`ParkedStream`], attached to the turn it reads, and released from the rounds when
/// the stream ends, however it ends.
pub(super) struct Parking {
    pub(super) stream: Arc<ParkedStream>,
    attached: Option<Arc<TurnBuffer>>,
    socket: Arc<Connection>,
}

impl Parking {
    pub(super) fn new(socket: &Arc<Connection>, encoding: Transport, metrics: Arc<Metrics>) -> Parking {
        let stream = ParkedStream::new(socket.clone(), encoding, metrics.deliveries.clone());
        Parking { stream, attached: None, socket: socket.clone() }
    }

    pub(super) fn attach(&mut self, buffer: &Arc<TurnBuffer>) {
        if self.attached.as_ref().is_some_and(|b| Arc::ptr_eq(b, buffer)) {
            return;
        }
        self.detach();
        buffer.attach(&self.stream);
        self.attached = Some(buffer.clone());
    }

    /// Takes the stream back from the rounds: moves `cursor` to where they left off and writes
    /// what the socket did not take of their last write. What they did; an error when a write
    /// failed (the client is gone).
    pub(super) async fn take_back(&self, cursor: &mut Cursor, drain: Duration) -> io::Result<Unparked> {
        let mut back = self.stream.unpark();
        cursor.seek(back.next);
        if let Some(rest) = back.rest.take() {
            write_all(&self.socket, &mut [IoSlice::new(&rest)], drain).await?;
        }
        if back.failed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        Ok(back)
    }

    pub(super) fn detach(&mut self) {
        if let Some(buffer) = self.attached.take() {
            buffer.detach(&self.stream);
        }
    }
}

impl Drop for Parking {
    fn drop(&mut self) {
        // Once this returns no round writes to the socket, nor holds it.
        self.stream.close();
        self.detach();
    }
}
