//! WebSocket sessions (RFC 6455, server side): every session the gateway serves, whether its
//! upgrade was the connection's first request (`net::http1`) or followed others (hyper hands
//! the socket back). The ops are the routes' ([`crate::live::Ops`]).
//!
//! One loop per session reads the client's frames, handles their ops, and writes everything the
//! session sends: replies, status changes, and the `chat.delta`s of its subscriptions, each
//! gathered from the hub cursors into one write. A session with a single subscription whose turn
//! is paced parks it ([`crate::hub::ParkedStream`]) like an SSE watcher, and the turn's rounds write
//! its `chat.delta` frames to the socket themselves; anything else the session has to write
//! takes the sink back first, so the frames on the socket never interleave.
//!
//! Frames from the client must be masked; fragmented messages are joined, pings answered,
//! a close answered with a close (an invalid close code with 1002). A protocol error, a text
//! message that is not UTF-8, or a message over `--max-body-bytes` is answered with a close
//! frame of code 1002, 1007 or 1009 and the connection ends; so is a frame or fragmented
//! message that does not arrive complete within `--ws-message-timeout-secs` (1008). A session still open at shutdown gets what its cursors hold, then a
//! close frame of code 1001.
//!
//! Every session hears every conversation's status changes, so when many turns start
//! or end together, writing each change as it comes would cost a wake-up and a write per change
//! per session. While deltas are paced (the hub's flush window is open), a session holds a
//! status change for one window and writes it with every other change that came meanwhile, or
//! sooner with anything else it writes; with the window closed it writes each change at once.

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use tokio::net::TcpStream;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::socket::{Connection, Parking, write_all};
use crate::encoding::Transport;
use crate::encoding::{WS_CLOSE, put_ws_frame};
use crate::hub::Delivery;
use crate::live::{Cancelled, Reading, ReadingBudget, Session};
use crate::status::StatusChange;

/// Close codes (RFC 6455, 7.4.1).
const GOING_AWAY: u16 = 1001;
const PROTOCOL_ERROR: u16 = 1002;
const INVALID_PAYLOAD: u16 = 1007;
const POLICY: u16 = 1008;
const TOO_BIG: u16 = 1009;
const INTERNAL: u16 = 1011;
/// The server is out of room for now (RFC 6455 7.4.1, registered 1013): the reading budget.
const TRY_AGAIN_LATER: u16 = 1013;

/// Most bytes one read of the client's socket takes.
const READ: usize = 16 * 1024;

/// Writes gathered past this size go out before more is gathered.
const GATHER: usize = 256 * 1024;

/// What a client sent.
#[derive(Debug, PartialEq, Eq)]
enum Incoming {
    Text(String),
    Binary(Vec<u8>),
    Ping(Vec<u8>),
    Pong,
    /// A close frame, with its code if it had one.
    Close(Option<u16>),
}

/// Decodes the client's frames from the bytes read so far.
struct FrameDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already decoded.
    at: usize,
    /// Largest message (joined fragments) taken.
    max: usize,
    /// A fragmented message so far: its opcode and payload.
    partial: Option<(u8, Vec<u8>)>,
    /// How much of a fragmented text message is known to be valid UTF-8: checked as each
    /// fragment comes, so a bad one fails at once (not after the rest of the message).
    valid: usize,
    /// Room in the reading budget for what `buf` and `partial` hold past one read.
    reading: Option<Reading>,
}

impl FrameDecoder {
    fn new(read: Vec<u8>, max: usize) -> FrameDecoder {
        FrameDecoder { buf: read, at: 0, max, partial: None, valid: 0, reading: None }
    }

    /// The next whole message or control frame, `None` until more bytes arrive, or the close
    /// code the connection must end with.
    fn next(&mut self) -> Result<Option<Incoming>, u16> {
        loop {
            let b = &self.buf[self.at..];
            if b.len() < 2 {
                return Ok(None);
            }
            let fin = b[0] & 0x80 != 0;
            let opcode = b[0] & 0x0f;
            if b[0] & 0x70 != 0 || b[1] & 0x80 == 0 {
                return Err(PROTOCOL_ERROR); // no extension was agreed; client frames are masked
            }
            let (len, header) = match b[1] & 0x7f {
                126 if b.len() >= 4 => (u64::from(u16::from_be_bytes([b[2], b[3]])), 4),
                127 if b.len() >= 10 => (u64::from_be_bytes(b[2..10].try_into().expect("eight bytes")), 10),
                126 | 127 => return Ok(None),
                n => (u64::from(n), 2),
            };
            let control = opcode >= 0x8;
            if control && (!fin || len > 125) {
                return Err(PROTOCOL_ERROR);
            }
            // A 64-bit length has its top bit clear (RFC 6455 5.2).
            if len >> 63 != 0 {
                return Err(PROTOCOL_ERROR);
            }
            // Control frames may come between fragments and count on their own.
            let so_far = if control { 0 } else { self.partial.as_ref().map_or(0, |(_, p)| p.len()) as u64 };
            if so_far.checked_add(len).is_none_or(|total| total > self.max as u64) {
                return Err(TOO_BIG);
            }
            // Within `max`, so within a usize; the frame's end is checked all the same.
            let len = len as usize;
            let Some(end) = (header + 4usize).checked_add(len) else { return Err(TOO_BIG) };
            if b.len() < end {
                // Read as the bytes come, not reserved from the header: a client that announces
                // a large frame and sends little holds only what it sent.
                return Ok(None);
            }
            let mask = [b[header], b[header + 1], b[header + 2], b[header + 3]];
            let mut payload = b[header + 4..end].to_vec();
            for (i, byte) in payload.iter_mut().enumerate() {
                *byte ^= mask[i % 4];
            }
            self.at += end;
            if self.at == self.buf.len() {
                self.buf = Vec::new();
                self.at = 0;
            }
            let (opcode, payload) = match opcode {
                0x0 => {
                    let Some((first, so_far)) = self.partial.as_mut() else { return Err(PROTOCOL_ERROR) };
                    so_far.extend_from_slice(&payload);
                    if *first == 0x1 && !fin {
                        self.valid = valid_prefix(so_far, self.valid)?;
                    }
                    if !fin {
                        continue;
                    }
                    self.partial.take().expect("a message in progress")
                }
                0x1 | 0x2 if self.partial.is_some() => return Err(PROTOCOL_ERROR),
                0x1 | 0x2 if !fin => {
                    self.valid = if opcode == 0x1 { valid_prefix(&payload, 0)? } else { 0 };
                    self.partial = Some((opcode, payload));
                    continue;
                }
                _ => (opcode, payload),
            };
            return match opcode {
                0x1 => String::from_utf8(payload).map(|t| Some(Incoming::Text(t))).map_err(|_| INVALID_PAYLOAD),
                0x2 => Ok(Some(Incoming::Binary(payload))),
                0x8 => match payload.len() {
                    0 => Ok(Some(Incoming::Close(None))),
                    1 => Err(PROTOCOL_ERROR),
                    _ if std::str::from_utf8(&payload[2..]).is_err() => Err(INVALID_PAYLOAD),
                    _ => match u16::from_be_bytes([payload[0], payload[1]]) {
                        code if valid_close_code(code) => Ok(Some(Incoming::Close(Some(code)))),
                        _ => Err(PROTOCOL_ERROR),
                    },
                },
                0x9 => Ok(Some(Incoming::Ping(payload))),
                0xA => Ok(Some(Incoming::Pong)),
                _ => Err(PROTOCOL_ERROR),
            };
        }
    }

    /// Keeps room in the gateway's reading budget for what an incomplete frame or message holds
    /// past one read's worth; false when the budget has no more.
    fn within(&mut self, budget: &ReadingBudget) -> bool {
        let holds = self.buf.len() - self.at + self.partial.as_ref().map_or(0, |(_, p)| p.len());
        if holds <= READ {
            self.reading = None;
            return true;
        }
        let has = self.reading.as_ref().map_or(0, Reading::bytes);
        if holds <= has {
            return true;
        }
        let Some(more) = budget.try_take(holds - has) else { return false };
        match &mut self.reading {
            Some(reading) => reading.merge(more),
            None => self.reading = Some(more),
        }
        true
    }

    /// Whether part of a frame, or of a fragmented message, has arrived and its rest has not.
    fn incomplete(&self) -> bool {
        self.at < self.buf.len() || self.partial.is_some()
    }

    /// Reads what the socket has (at most [`READ`] bytes): false once the client is gone. Read
    /// through the stack, so an idle session holds no read buffer.
    fn read(&mut self, stream: &TcpStream) -> io::Result<bool> {
        if self.at > 0 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        let mut scratch = [0u8; READ];
        match stream.try_read(&mut scratch) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.buf.extend_from_slice(&scratch[..n]);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(true),
            Err(e) => Err(e),
        }
    }
}

/// How much of `bytes` is valid UTF-8, given that the first `from` bytes are; an error when
/// what is there can never become UTF-8 (an incomplete character at the end can).
fn valid_prefix(bytes: &[u8], from: usize) -> Result<usize, u16> {
    match std::str::from_utf8(&bytes[from..]) {
        Ok(_) => Ok(bytes.len()),
        Err(e) if e.error_len().is_some() => Err(INVALID_PAYLOAD),
        Err(e) => Ok(from + e.valid_up_to()),
    }
}

/// Whether a peer may send `code` in a close frame (RFC 6455 7.4): the defined codes but those
/// reserved for "no code" (1005), "abnormal" (1006) and TLS (1015); 3000-4999 for libraries and
/// applications.
fn valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// A close frame with `code`.
fn put_close(out: &mut BytesMut, code: Option<u16>, reason: &str) {
    let mut payload = Vec::new();
    if let Some(code) = code {
        payload.extend_from_slice(&code.to_be_bytes());
        // A control frame's payload is at most 125 bytes: the reason is cut at a character.
        let mut end = reason.len().min(123);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        payload.extend_from_slice(&reason.as_bytes()[..end]);
    }
    put_ws_frame(out, WS_CLOSE, &payload);
}

/// What the session woke up for.
enum Woke {
    /// A waiting subscription's delivery.
    Delivery(Arc<str>, Delivery),
    /// A round handed the parked subscription back.
    Handed,
    Readable,
    Status(Result<StatusChange, RecvError>),
    /// The status changes held since the first of them are due.
    StatusesDue,
    Ping,
    Drained,
    /// A frame or fragmented message did not arrive complete in time.
    Incomplete,
}

/// What a session waits for besides its turns and its client: status changes (and the end of
/// the flush window that holds them), the keep-alive ping, shutdown's drain, and the deadline of
/// a frame or message left incomplete.
struct Waits {
    statuses: tokio::sync::broadcast::Receiver<StatusChange>,
    /// Status changes held for one flush window, and when that window ends.
    held: Vec<StatusChange>,
    held_until: Option<Pin<Box<tokio::time::Sleep>>>,
    ping: Option<tokio::time::Interval>,
    drained: Cancelled,
    /// Armed while a frame or message is incomplete; the client must finish it by then.
    incomplete_until: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Waits {
    /// Hands the held status changes to the session (its next write carries them).
    fn release(&mut self, session: &mut Session) {
        self.held_until = None;
        release(session, &mut self.held, &mut self.statuses);
    }
}

/// Serves the session until it ends; `read` holds what the client sent after its upgrade.
pub async fn serve(stream: &Arc<Connection>, mut session: Session, read: Vec<u8>, drain: Duration) {
    let mut frames = FrameDecoder::new(read, session.max_message);
    let message_timeout = session.message_timeout;
    let Some(statuses) = session.take_statuses() else { return };
    let mut waits = Waits {
        statuses,
        held: Vec::new(),
        held_until: None,
        ping: session.keepalive.map(|p| tokio::time::interval_at(tokio::time::Instant::now() + p, p)),
        drained: Cancelled::new(&session.drained),
        incomplete_until: None,
    };
    let mut parking = Parking::new(stream, Transport::WebSocket, session.metrics.clone());
    let mut out = BytesMut::new();
    let mut draining = false;
    let mut woke = None;
    let end = loop {
        match woke.take() {
            Some(Woke::Delivery(id, delivery)) => {
                if !deliver(&mut session, &mut out, &id, delivery).await {
                    break Some(INTERNAL);
                }
            }
            Some(Woke::Readable) => match frames.read(stream) {
                Ok(true) => {}
                Ok(false) | Err(_) => break None,
            },
            Some(Woke::Status(Ok(change))) => {
                waits.held.push(change);
                let window = session.window();
                if window.is_zero() {
                    waits.release(&mut session);
                } else if waits.held_until.is_none() {
                    waits.held_until = Some(Box::pin(tokio::time::sleep(window)));
                }
            }
            Some(Woke::StatusesDue) => waits.release(&mut session),
            Some(Woke::Status(Err(RecvError::Lagged(missed)))) => {
                tracing::debug!(missed, "status changes lagged on a WebSocket");
            }
            Some(Woke::Status(Err(RecvError::Closed))) => draining = true,
            Some(Woke::Ping) => session.ping(),
            // The credential that opened the session was taken back: it closes now (1008).
            Some(Woke::Drained) if session.ended().is_some() => break Some(POLICY),
            Some(Woke::Drained) => draining = true,
            Some(Woke::Incomplete) => break Some(POLICY),
            Some(Woke::Handed) | None => {}
        }
        if let Some(code) = read_ops(&mut session, &mut frames).await {
            break code;
        }
        // The deadline runs from the first byte of an incomplete frame to its last.
        match (frames.incomplete(), waits.incomplete_until.is_some()) {
            (true, false) => waits.incomplete_until = Some(Box::pin(tokio::time::sleep(message_timeout))),
            (false, true) => waits.incomplete_until = None,
            _ => {}
        }
        if !frames.within(&session.reading) {
            break Some(TRY_AGAIN_LATER);
        }
        // Everything there is to write, in one write; held status changes go with it.
        if !waits.held.is_empty() && !session.out().is_empty() {
            waits.release(&mut session);
        }
        out.extend_from_slice(&session.out().split());
        if !gather(&mut session, &mut out, draining).await {
            break Some(INTERNAL);
        }
        if !out.is_empty() {
            if write_all(stream, &mut [IoSlice::new(&out)], drain).await.is_err() {
                return;
            }
            // Not kept: the session may idle for hours.
            out = BytesMut::new();
            continue;
        }
        if draining {
            break Some(GOING_AWAY);
        }
        match wait(stream, &mut session, &mut parking, &mut waits, drain).await {
            Some(next) => woke = Some(next),
            None => return,
        }
    };
    drop(parking);
    // Whatever was gathered and held, then the close frame (best effort: the client may be gone).
    waits.release(&mut session);
    out.extend_from_slice(&session.out().split());
    let reason = match (end, session.ended()) {
        (Some(POLICY), Some(why)) => format!("credential taken back: {why}"),
        _ => String::new(),
    };
    put_close(&mut out, end, &reason);
    let _ = write_all(stream, &mut [IoSlice::new(&out)], drain).await;
}

/// Handles the client's ops decoded so far; the close code to answer with (`Some(None)`: a
/// close without one) when the client closes or breaks the protocol.
async fn read_ops(session: &mut Session, frames: &mut FrameDecoder) -> Option<Option<u16>> {
    loop {
        // Nothing a client sends after its credential was taken back is acted on.
        if session.ended().is_some() {
            return Some(Some(POLICY));
        }
        match frames.next() {
            Ok(Some(Incoming::Text(t))) => session.handle(&t).await,
            Ok(Some(Incoming::Binary(b))) => match std::str::from_utf8(&b) {
                Ok(t) => session.handle(t).await,
                Err(_) => session.send(&serde_json::json!({"type": "error", "message": "Invalid JSON"})),
            },
            Ok(Some(Incoming::Ping(p))) => session.pong(&p),
            Ok(Some(Incoming::Pong)) => {}
            // Answered with the same code (none for none).
            Ok(Some(Incoming::Close(code))) => return Some(code),
            Ok(None) => return None,
            Err(code) => return Some(Some(code)),
        }
    }
}

/// Waits for what the session does next, with nothing to write now. A session with one
/// subscription reading an in-flight turn parks its socket with the turn's rounds meanwhile
/// (and takes it back, with what they wrote, before it goes on); `None`: the connection is gone.
async fn wait(
    stream: &Arc<Connection>,
    session: &mut Session,
    parking: &mut Parking,
    waits: &mut Waits,
    drain: Duration,
) -> Option<Woke> {
    let Waits { statuses, held_until, ping, drained, incomplete_until, .. } = waits;
    if let Some((buffer, next)) = session.subscriptions().parkable() {
        parking.attach(&buffer);
        parking.stream.park(buffer.as_ref(), next);
        let handed = parking.stream.handed_back();
        let status = next_status(statuses, held_until);
        tokio::pin!(handed, status);
        let woke = poll_fn(|cx| {
            if handed.as_mut().poll(cx).is_ready() {
                Poll::Ready(Woke::Handed)
            } else if stream.poll_read_ready(cx).is_ready() {
                Poll::Ready(Woke::Readable)
            } else if let Poll::Ready(woke) = status.as_mut().poll(cx) {
                Poll::Ready(woke)
            } else if ping.as_mut().is_some_and(|t| t.poll_tick(cx).is_ready()) {
                Poll::Ready(Woke::Ping)
            } else if Pin::new(&mut *drained).poll(cx).is_ready() {
                Poll::Ready(Woke::Drained)
            } else if incomplete_until.as_mut().is_some_and(|t| t.as_mut().poll(cx).is_ready()) {
                Poll::Ready(Woke::Incomplete)
            } else {
                Poll::Pending
            }
        })
        .await;
        let cursor = session.subscriptions().single().expect("the parked subscription is at hand");
        parking.take_back(cursor, drain).await.ok()?;
        return Some(woke);
    }
    // What came since the gather; otherwise every subscription now waits.
    if let Some((id, delivery)) = session.subscriptions().try_next(false) {
        return Some(Woke::Delivery(id, delivery));
    }
    parking.detach();
    // The client first: its ops are few and cheap, and a busy turn must not keep them (an
    // unsubscribe, a close) waiting.
    Some(tokio::select! {
        biased;
        r = stream.readable() => match r {
            Ok(()) => Woke::Readable,
            Err(_) => return None,
        },
        _ = until(incomplete_until.as_mut()) => Woke::Incomplete,
        (id, d) = session.subscriptions().next() => Woke::Delivery(id, d),
        woke = next_status(statuses, held_until) => woke,
        _ = tick(ping.as_mut()) => Woke::Ping,
        _ = &mut *drained => Woke::Drained,
    })
}

/// The ticker's next tick; never, without one.
async fn tick(ticker: Option<&mut tokio::time::Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Resolves when the deadline passes; never, without one.
async fn until(deadline: Option<&mut Pin<Box<tokio::time::Sleep>>>) {
    match deadline {
        Some(sleep) => sleep.as_mut().await,
        None => std::future::pending().await,
    }
}

/// The next status change, or (while some are held) the end of their window: no wake-up per
/// change meanwhile, the channel keeps them.
async fn next_status(
    statuses: &mut tokio::sync::broadcast::Receiver<StatusChange>,
    held_until: &mut Option<Pin<Box<tokio::time::Sleep>>>,
) -> Woke {
    match held_until {
        Some(until) => {
            until.as_mut().await;
            Woke::StatusesDue
        }
        None => Woke::Status(statuses.recv().await),
    }
}

/// Queues the held status changes and every one the channel has, in the order they came.
fn release(
    session: &mut Session,
    held: &mut Vec<StatusChange>,
    statuses: &mut tokio::sync::broadcast::Receiver<StatusChange>,
) {
    for change in held.drain(..) {
        session.status_changed(&change);
    }
    loop {
        match statuses.try_recv() {
            Ok(change) => session.status_changed(&change),
            // Over the channel's capacity within one window: the oldest are gone, the rest follow.
            Err(TryRecvError::Lagged(missed)) => tracing::debug!(missed, "status changes lagged on a WebSocket"),
            Err(_) => break,
        }
    }
}

/// Adds what the subscriptions have ready to `out`, up to [`GATHER`] bytes (at shutdown, then
/// drops them all). False when a resync could not be built (the session must end).
async fn gather(session: &mut Session, out: &mut BytesMut, draining: bool) -> bool {
    while out.len() < GATHER {
        let Some((id, delivery)) = session.subscriptions().try_next(!draining) else { break };
        if !deliver(session, out, &id, delivery).await {
            return false;
        }
    }
    if draining {
        session.subscriptions().clear();
    }
    true
}

/// Adds one subscription's delivery to `out`; false when its resync could not be built.
async fn deliver(session: &mut Session, out: &mut BytesMut, id: &str, delivery: Delivery) -> bool {
    match delivery {
        Delivery::Events(events) => {
            session.metrics.deliveries.events.fetch_add(events.len() as u64, std::sync::atomic::Ordering::Relaxed);
            for event in &events {
                Transport::WebSocket.put(out, event);
            }
        }
        Delivery::Lost { turn_id } => {
            if !session.resync(id, &turn_id).await {
                return false;
            }
            out.extend_from_slice(&session.out().split());
        }
        Delivery::End => {}
    }
    true
}

#[cfg(test)]
mod tests;
