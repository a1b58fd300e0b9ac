//! Parked streams: live streams whose socket a turn's rounds write to themselves.
//!
//! A watcher that has read everything there is would otherwise wait for a round's wake-up, be
//! scheduled, poll its way down to its cursor, write, and register to wait again: several
//! microseconds of user-space work per write, which under a paced fan-out of thousands of
//! streams costs about as much CPU as the writes themselves. So a stream whose transport writes
//! its socket itself parks instead while the turn's deltas are paced: it hands its position to a
//! [`ParkedStream`] attached to the turn's buffer, and each round writes the new events to every
//! parked stream it is for with one non-blocking write through the transport's [`Socket`],
//! building each distinct chunk once per round.
//!
//! The stream's task stays the owner of everything else. A round hands the stream back (unparks
//! it and wakes the task) whenever it cannot simply write and move on: the socket did not take
//! the whole chunk (the task writes the rest, with the drain timeout), a write failed, the batch
//! was capped, the batch held `turn-sealed`, or the position was coalesced away. Every write
//! while parked happens under the stream's lock and moves its position, so a round and the task
//! never both write, and the bytes on the socket stay in order.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::Notify;

use super::pacing::PHASES;
use crate::encoding::Transport;

/// What deliveries cost in writes, counted for the gateway's `/metrics`.
#[derive(Debug, Default)]
pub struct Deliveries {
    /// Events written to watchers, by rounds and by the streams' own tasks.
    pub events: AtomicU64,
    /// Socket writes made by turns' rounds for parked streams.
    pub round_writes: AtomicU64,
    /// Of those, writes the socket took only part of (its stream's task writes the rest).
    pub round_short_writes: AtomicU64,
}

/// The transport's side of a parked stream: its socket, written without waiting.
pub trait Socket: Send + Sync {
    /// Writes as much of `bytes` as the socket takes now; `WouldBlock` when it takes nothing.
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize>;
}

/// A stream's socket and position, which rounds write to while the stream is parked.
pub struct ParkedStream {
    encoding: Transport,
    counts: Arc<Deliveries>,
    state: Mutex<ParkedState>,
    /// Tells the stream's task that the round handed the stream back.
    handed: Notify,
}

struct ParkedState {
    /// The socket, until the stream lets it go ([`ParkedStream::close`]): no round writes after.
    socket: Option<Arc<dyn Socket>>,
    parked: bool,
    /// The buffer it is parked on (its address: the owner holds it while parked), so that a
    /// round of an earlier turn that still holds the stream in its copy of the list leaves it be.
    on: usize,
    /// Index of the next event to write.
    next: u32,
    /// Bytes of a written batch the socket did not take.
    rest: Option<Bytes>,
    failed: bool,
    /// A written batch ended with `turn-sealed`.
    sealed: bool,
    /// Something was written since the task last looked.
    sent: bool,
}

/// What a round did for the task while its sink was parked.
#[derive(Debug, Default)]
pub struct Unparked {
    /// Where the task's cursor goes on from.
    pub next: u32,
    /// Bytes the task must write first.
    pub rest: Option<Bytes>,
    /// A write failed: the connection is gone.
    pub failed: bool,
    /// `turn-sealed` was written.
    pub sealed: bool,
    /// Something was written.
    pub sent: bool,
}

/// Chunks built in one round, shared by every stream at the same position.
#[derive(Default)]
pub(super) struct Chunks {
    built: Vec<(u32, Transport, Built)>,
}

/// One write of a stream's events, as its transport frames them.
#[derive(Clone)]
pub struct Built {
    pub(super) chunk: Bytes,
    pub(super) events: usize,
    pub(super) next: u32,
    pub(super) sealed: bool,
    pub(super) more: bool,
}

/// What a stream's position reads now.
pub enum Ready {
    Nothing,
    /// The position is gone (coalesced or evicted): the stream's task must look.
    Lost,
    Chunk(Built),
}

/// What a round reads parked streams' writes from: the turn's buffer (`buffer.rs`), which
/// knows its events; this file knows only the streams.
pub trait Batches {
    /// The events from `next` on as one write in `encoding`.
    fn batch(&self, next: u32, encoding: Transport) -> Ready;
}

/// Where a buffer is, to tell whether a stream is parked on it.
fn address(buffer: &impl Batches) -> usize {
    std::ptr::from_ref(buffer).cast::<()>() as usize
}

impl ParkedStream {
    /// A stream that rounds may write to through `socket` while it is parked.
    pub fn new(socket: Arc<dyn Socket>, encoding: Transport, counts: Arc<Deliveries>) -> Arc<ParkedStream> {
        let state = ParkedState {
            socket: Some(socket),
            parked: false,
            on: 0,
            next: 0,
            rest: None,
            failed: false,
            sealed: false,
            sent: false,
        };
        Arc::new(ParkedStream { encoding, counts, state: Mutex::new(state), handed: Notify::new() })
    }

    fn lock(&self) -> MutexGuard<'_, ParkedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Parks at event `next` of `buffer` (to which the stream must be attached), and writes
    /// whatever was published before the stream was there for a round to see.
    pub fn park(&self, buffer: &impl Batches, next: u32) {
        let mut st = self.lock();
        st.parked = true;
        st.on = address(buffer);
        st.next = next;
        self.pump_locked(&mut st, buffer, &mut Chunks::default());
    }

    /// Takes the stream back from the rounds; what they did meanwhile.
    pub fn unpark(&self) -> Unparked {
        let mut st = self.lock();
        st.parked = false;
        Unparked {
            next: st.next,
            rest: st.rest.take(),
            failed: std::mem::take(&mut st.failed),
            sealed: std::mem::take(&mut st.sealed),
            sent: std::mem::take(&mut st.sent),
        }
    }

    /// Takes the stream back for good and lets its socket go: once this returns, no round
    /// writes to the socket, and the stream holds no reference to it.
    pub fn close(&self) {
        let mut st = self.lock();
        st.parked = false;
        st.socket = None;
    }

    /// Resolves once a round has handed the stream back (or spuriously: unpark and look).
    pub async fn handed_back(&self) {
        self.handed.notified().await;
    }

    /// Hands the stream back to its task if it is parked.
    pub(super) fn release(&self) {
        let mut st = self.lock();
        if st.parked {
            self.hand_back(&mut st);
        }
    }

    /// A round's turn at this stream: writes the events past its position, if it is parked.
    /// Whether it wrote to the socket.
    pub(super) fn pump(&self, buffer: &impl Batches, chunks: &mut Chunks) -> bool {
        let mut st = self.lock();
        self.pump_locked(&mut st, buffer, chunks)
    }

    fn pump_locked(&self, st: &mut ParkedState, buffer: &impl Batches, chunks: &mut Chunks) -> bool {
        if !st.parked || st.on != address(buffer) {
            return false;
        }
        let Some(socket) = st.socket.as_deref() else { return false };
        let built = match chunks.built.iter().find(|(next, encoding, _)| *next == st.next && *encoding == self.encoding)
        {
            Some((_, _, built)) => built.clone(),
            None => match buffer.batch(st.next, self.encoding) {
                Ready::Nothing => return false,
                Ready::Lost => {
                    self.hand_back(st);
                    return false;
                }
                Ready::Chunk(built) => {
                    chunks.built.push((st.next, self.encoding, built.clone()));
                    built
                }
            },
        };
        let taken = match socket.try_write(&built.chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(_) => {
                st.failed = true;
                self.hand_back(st);
                return true;
            }
        };
        self.counts.round_writes.fetch_add(1, Relaxed);
        self.counts.events.fetch_add(built.events as u64, Relaxed);
        st.next = built.next;
        st.sent = true;
        st.sealed = built.sealed;
        if taken < built.chunk.len() {
            self.counts.round_short_writes.fetch_add(1, Relaxed);
            st.rest = Some(built.chunk.slice(taken..));
        }
        if st.rest.is_some() || built.sealed || built.more {
            self.hand_back(st);
        }
        true
    }

    fn hand_back(&self, st: &mut ParkedState) {
        st.parked = false;
        self.handed.notify_one();
    }
}

/// The parked streams attached to a turn, each with its phase (see `pacing.rs`).
#[derive(Default)]
pub(super) struct Attached {
    streams: Vec<(u32, Arc<ParkedStream>)>,
    /// The phase the next stream gets: streams take the phases in turn.
    next_phase: u32,
}

impl Attached {
    /// Lets rounds write to `stream` (parked or not), in the next phase.
    pub(super) fn attach(&mut self, stream: &Arc<ParkedStream>) {
        let phase = self.next_phase;
        self.next_phase = phase.wrapping_add(1);
        self.streams.push((phase, stream.clone()));
    }

    pub(super) fn detach(&mut self, stream: &Arc<ParkedStream>) {
        self.streams.retain(|(_, s)| !Arc::ptr_eq(s, stream));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// The streams of the phases due in a share of `k` (all of them without).
    pub(super) fn due(&self, phases: Option<(u32, [bool; PHASES])>) -> Vec<Arc<ParkedStream>> {
        let due = |phase: u32| phases.is_none_or(|(k, due)| due[(phase % k) as usize]);
        self.streams.iter().filter(|(phase, _)| due(*phase)).map(|(_, s)| s.clone()).collect()
    }
}

#[cfg(test)]
mod tests;
