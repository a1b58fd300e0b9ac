//! The replay buffer of one turn: its events, coalesced past a cap, and the rounds that wake
//! its watchers (when, decided by `pacing.rs`; whom, woken tasks and parked streams).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::pacing::{Decision, FlushWindow, PHASES, Pacing, Round};
use super::parked::{Attached, Batches, Built, Chunks, ParkedStream, Ready};
use super::remote::Outbox;
use crate::encoding::{EncodedEvent, Kind, Transport};
use crate::wire::{AgentEvent, TurnReasoningDeltaEvent, TurnTextDeltaEvent};

/// Most events one batch hands out: enough to make a write carry many events under load, few
/// enough (tens of KiB) that a lagging connection holds little beside the shared buffer.
pub const BATCH: usize = 128;

/// Most bytes one batch holds (as NDJSON lines; the other framings are about as long), at
/// least one event: a batch of large events (tool results of MiBs) would otherwise be joined
/// into one write of up to `BATCH` of them, held whole by a connection that stopped reading.
pub const BATCH_BYTES: usize = 256 * 1024;

// The buffer's read API, which cursors and the rounds share: where a position starts, and
// where a batch from it ends.

/// Where the events from index `next` on start: the first one whose last index is at or past
/// `next`. Until a coalescing pass event `i` is at `i`, so that place is checked first (two
/// events, instead of a binary search touching one at every step).
pub(super) fn start_of(events: &[Arc<EncodedEvent>], next: u32) -> usize {
    let i = next as usize;
    if i <= events.len() && (i == 0 || events[i - 1].last < next) && events.get(i).is_none_or(|f| f.last >= next) {
        return i;
    }
    events.partition_point(|f| f.last < next)
}

/// Where a batch from `start` ends: after `max` events, or the first event that brings it to
/// `BATCH_BYTES`. `largest` is the longest line among `events`: when `max` of them cannot reach
/// the bytes (deltas, the usual case) the events are not looked at.
pub(super) fn batch_end(events: &[Arc<EncodedEvent>], largest: usize, start: usize, max: usize) -> usize {
    let most = events.len().min(start.saturating_add(max));
    if largest.saturating_mul(most - start.min(most)) < BATCH_BYTES {
        return most;
    }
    let mut bytes = 0;
    for (i, event) in events.iter().enumerate().take(most).skip(start) {
        bytes += event.line.len();
        if bytes >= BATCH_BYTES {
            return i + 1;
        }
    }
    most
}

/// Where the next turn of a conversation will appear: each buffer holds the one its successor
/// fills, so a watcher still reading turn N finds turn N+1 even if that one has already sealed.
#[derive(Default)]
pub(super) struct NextTurn {
    pub(super) turn: OnceLock<Arc<TurnBuffer>>,
    pub(super) filled: Notify,
}

#[derive(Default)]
pub(super) struct BufferState {
    pub(super) events: Vec<Arc<EncodedEvent>>,
    /// Index the next published event gets.
    next_index: u32,
    bytes: usize,
    /// The longest NDJSON line among `events` (at least: events that went keep their share), so
    /// that a batch of small events needs no sum of its bytes (see `cursor::batch_end`).
    pub(super) largest: usize,
    /// Coalesce when `bytes` passes this (the cap, raised after each pass so that passes are
    /// at least half a cap of new events apart).
    threshold: usize,
    pub(super) sealed: bool,
}

/// The replay buffer of one turn: every event from `user-message` on.
pub struct TurnBuffer {
    pub conversation_id: Arc<str>,
    pub turn_id: Arc<str>,
    caps: super::Caps,
    state: RwLock<BufferState>,
    pub(super) grown: Notify,
    pacing: Mutex<Pacing>,
    /// Watchers reading in-flight turns, hub-wide.
    pub(super) readers: Arc<AtomicUsize>,
    /// Bytes held by every live buffer, hub-wide.
    held: Arc<AtomicUsize>,
    pub(super) flush: Arc<FlushWindow>,
    pub(super) next: Arc<NextTurn>,
    /// Streams a round writes to itself while they are parked (see `parked.rs`).
    pub(super) parked: Mutex<Attached>,
    /// A round under a closed window waits for its task (see [`TurnBuffer::round_soon`]).
    round_due: AtomicBool,
    /// Where the events of a turn this gateway runs go to other gateways (none: it runs on
    /// another gateway, or there is no bus).
    outbox: Option<Outbox>,
}

impl Drop for TurnBuffer {
    fn drop(&mut self) {
        let bytes = self.state.get_mut().unwrap_or_else(|p| p.into_inner()).bytes;
        self.held.fetch_sub(bytes, Relaxed);
    }
}

impl TurnBuffer {
    pub(super) fn new(
        conversation_id: &str,
        turn_id: &str,
        caps: super::Caps,
        flush: Arc<FlushWindow>,
        readers: Arc<AtomicUsize>,
        held: Arc<AtomicUsize>,
        outbox: Option<Outbox>,
    ) -> TurnBuffer {
        TurnBuffer {
            conversation_id: Arc::from(conversation_id),
            turn_id: Arc::from(turn_id),
            caps,
            state: RwLock::new(BufferState { threshold: caps.coalesce, ..BufferState::default() }),
            grown: Notify::new(),
            pacing: Mutex::default(),
            readers,
            held,
            flush,
            next: Arc::default(),
            parked: Mutex::default(),
            round_due: AtomicBool::new(false),
            outbox,
        }
    }

    pub(super) fn state(&self) -> RwLockReadGuard<'_, BufferState> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Encodes the event once, appends it, and wakes every reader waiting at the end.
    /// Returns the event's index in the turn.
    pub fn publish(self: &Arc<Self>, event: &AgentEvent) -> u32 {
        let (index, paced) = self.append(event, false);
        self.wake(paced);
        index
    }

    /// Publishes a run of events that arrived together (from another gateway, in one bus
    /// message) with one round for all of them, as a turn's opening events are: a round per
    /// event would cost every watcher a write per event.
    pub fn publish_all(self: &Arc<Self>, events: &[AgentEvent]) {
        let mut paced = true;
        for event in events {
            paced &= self.append(event, false).1;
        }
        if !events.is_empty() {
            self.wake(paced);
        }
    }

    /// Encodes and appends the event; its index, and whether its round may be paced.
    pub(super) fn append(&self, event: &AgentEvent, last: bool) -> (u32, bool) {
        let (kind, json) = EncodedEvent::encode(event);
        let paced = kind.is_delta() && !last;
        let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
        let index = st.next_index;
        let encoded = Arc::new(EncodedEvent::build(&self.turn_id, index, index, kind, &json));
        st.next_index += 1;
        st.bytes += encoded.size();
        st.largest = st.largest.max(encoded.line.len());
        self.held.fetch_add(encoded.size(), Relaxed);
        if let Some(outbox) = &self.outbox {
            outbox.send(index, &encoded.line, last);
        }
        st.events.push(encoded);
        st.sealed = last;
        if st.bytes > st.threshold {
            self.coalesce(&mut st);
        }
        if st.bytes > self.caps.turn || self.held.load(Relaxed) > self.caps.total {
            self.evict(&mut st);
        }
        (index, paced)
    }

    /// Sends nothing more of this turn to other gateways: it lost its lease, and another
    /// gateway tells them how it ended.
    pub fn leave_bus(&self) {
        if let Some(outbox) = &self.outbox {
            outbox.close();
        }
    }

    /// Sends what the turn published since its last round to the other gateways (`remote.rs`).
    pub(super) fn to_bus(&self) {
        if let Some(outbox) = &self.outbox {
            outbox.release();
        }
    }

    /// The flush window for paced deltas right now.
    pub(super) fn window(&self) -> Duration {
        self.flush.for_readers(self.readers.load(Relaxed))
    }

    /// Whether deltas are paced now: the window is open (a round carries what it gathered), or
    /// the turn's deltas come far enough apart that a round per delta writes no more than
    /// woken watchers would (see [`Pacing::spaced`]). Only then may a watcher park: rounds of
    /// a burst under a closed window would write every single event.
    pub fn paced(&self) -> bool {
        let readers = self.readers.load(Relaxed);
        !self.flush.for_readers(readers).is_zero() || self.pacing().spaced(self.flush.sweep(readers))
    }

    fn pacing(&self) -> MutexGuard<'_, Pacing> {
        self.pacing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the round the pacing decides for an event just published (see `pacing.rs`).
    pub(super) fn wake(self: &Arc<Self>, paced: bool) {
        let window = if paced { self.window() } else { Duration::ZERO };
        let now = Instant::now();
        let mut pacing = self.pacing();
        let Decision { mut round, deadline } = pacing.decide(now, window, paced);
        if let Some(at) = deadline
            && !self.arm(&mut pacing, at)
        {
            // No runtime to time the deadline: nothing may wait for it.
            pacing.everyone(now);
            round = Round::Everyone;
        }
        drop(pacing);
        self.run(round);
    }

    fn run(self: &Arc<Self>, round: Round) {
        // The bus goes with the woken tasks: every round of everyone, and phase 0's.
        if matches!(round, Round::Everyone | Round::Phases { due: [true, ..], .. }) {
            self.to_bus();
        }
        match round {
            Round::Everyone => {
                self.grown.notify_waiters();
                if self.window().is_zero() {
                    self.round_soon();
                } else {
                    write_round(self, None);
                }
            }
            Round::Phases { k, due } => {
                if due[0] {
                    self.grown.notify_waiters();
                }
                write_round(self, Some((k, due)));
            }
            Round::Held => {}
        }
    }

    /// A round of everyone under a closed window: in a task of its own, which runs once the
    /// publisher yields, so that a burst it publishes meanwhile (a runtime's events that came
    /// together) goes out in the same round, one write per watcher, as woken watchers would
    /// take it. Without a runtime, at once.
    fn round_soon(self: &Arc<Self>) {
        if self.attached().is_empty() || self.round_due.swap(true, AcqRel) {
            return; // no stream to write, or the round to come takes this event too
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.round_due.store(false, Relaxed);
            return write_round(self, None);
        };
        let buffer = Arc::downgrade(self);
        runtime.spawn(async move {
            let Some(buffer) = buffer.upgrade() else { return };
            // Before the round reads the events: one published after it looks starts another.
            buffer.round_due.swap(false, AcqRel);
            write_round(&buffer, None);
        });
    }

    /// Makes sure a round of everyone starts at `at` unless one starts before; false without
    /// a runtime to time it.
    fn arm(self: &Arc<Self>, pacing: &mut Pacing, at: Instant) -> bool {
        if pacing.timer.is_some_and(|timer| timer <= at) {
            return true; // that timer sleeps on to the new deadline
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return false };
        pacing.timer = Some(at);
        let buffer: Weak<TurnBuffer> = Arc::downgrade(self);
        runtime.spawn(async move {
            let mut sleep_to = at;
            loop {
                tokio::time::sleep_until(sleep_to).await;
                let Some(buffer) = buffer.upgrade() else { return };
                let mut pacing = buffer.pacing();
                if pacing.timer != Some(sleep_to) {
                    return; // an earlier timer took over
                }
                match pacing.deadline {
                    Some(deadline) if deadline > Instant::now() => {
                        sleep_to = deadline;
                        pacing.timer = Some(deadline);
                    }
                    Some(_) => {
                        pacing.timer = None;
                        pacing.everyone(Instant::now());
                        drop(pacing);
                        return buffer.run(Round::Everyone);
                    }
                    None => {
                        pacing.timer = None;
                        return;
                    }
                }
            }
        });
        true
    }

    /// Merges every run of two or more consecutive same-kind deltas into one event.
    fn coalesce(&self, st: &mut BufferState) {
        let before = st.bytes;
        let mut out: Vec<Arc<EncodedEvent>> = Vec::with_capacity(st.events.len());
        let mut run: Vec<Arc<EncodedEvent>> = Vec::new();
        let flush = |run: &mut Vec<Arc<EncodedEvent>>, out: &mut Vec<Arc<EncodedEvent>>| {
            if run.len() < 2 {
                out.append(run);
                return;
            }
            let first = run[0].first;
            let last = run[run.len() - 1].last;
            let text: String = run.iter().filter_map(|f| f.delta()).collect();
            let (conversation_id, turn_id) = (self.conversation_id.to_string(), self.turn_id.to_string());
            let event = if run[0].kind == Kind::Text {
                AgentEvent::TextDelta(TurnTextDeltaEvent { conversation_id, turn_id, delta: text })
            } else {
                AgentEvent::ReasoningDelta(TurnReasoningDeltaEvent { conversation_id, turn_id, delta: text })
            };
            out.push(Arc::new(EncodedEvent::new(&self.turn_id, first, last, &event)));
            run.clear();
        };
        for event in st.events.drain(..) {
            let joins = event.kind.is_delta() && run.last().is_none_or(|r| r.kind == event.kind);
            if !joins {
                flush(&mut run, &mut out);
            }
            if event.kind.is_delta() {
                run.push(event);
            } else {
                out.push(event);
            }
        }
        flush(&mut run, &mut out);
        st.events = out;
        st.bytes = st.events.iter().map(|f| f.size()).sum();
        st.largest = st.events.iter().map(|f| f.line.len()).max().unwrap_or(0);
        // The change, either way (the atomic add wraps like the subtraction).
        self.held.fetch_add(st.bytes.wrapping_sub(before), Relaxed);
        st.threshold = self.caps.coalesce.max(st.bytes + self.caps.coalesce / 2);
        tracing::debug!(turn = %self.turn_id, before, after = st.bytes, "coalesced the replay buffer");
    }

    /// Drops the oldest events until the buffer is within its cap and the hub within its total
    /// (or only the newest event is left): a watcher whose position went with them is `Lost`
    /// and reads history (`resync`), as one whose position was coalesced away. Three quarters
    /// of the cap stay after a pass, so passes are a quarter of a cap of new events apart.
    fn evict(&self, st: &mut BufferState) {
        let before = st.bytes;
        let goal = self.caps.turn / 4 * 3;
        let over_total = self.held.load(Relaxed).saturating_sub(self.caps.total / 4 * 3);
        let mut dropped = 0;
        let mut n = 0;
        while n + 1 < st.events.len() && (before - dropped > goal || dropped < over_total) {
            dropped += st.events[n].size();
            n += 1;
        }
        st.events.drain(..n);
        st.bytes -= dropped;
        self.held.fetch_sub(dropped, Relaxed);
        tracing::warn!(turn = %self.turn_id, before, after = st.bytes, events = n, "the replay buffer is at its cap: its oldest events went");
    }

    pub(super) fn attached(&self) -> MutexGuard<'_, Attached> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets rounds write to `stream` (parked or not).
    pub fn attach(&self, stream: &Arc<ParkedStream>) {
        self.attached().attach(stream);
    }

    pub fn detach(&self, stream: &Arc<ParkedStream>) {
        self.attached().detach(stream);
    }

    /// Bytes held by the events of this turn.
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }

    /// Number of events published so far.
    pub fn published(&self) -> u32 {
        self.state().next_index
    }
}

/// A round with more parked streams than this shares them out among the runtime's workers.
pub(super) const SHARED_PAST: usize = 64;

/// Most streams one part of a shared round writes to (a few milliseconds of writes), so that a
/// round of many thousands keeps no worker, and no turn, busy for long.
const PART: usize = 512;

impl Batches for TurnBuffer {
    /// The events from `next` on as one write, framed by the transport.
    fn batch(&self, next: u32, encoding: Transport) -> Ready {
        let st = self.state();
        let start = start_of(&st.events, next);
        let Some(first) = st.events.get(start) else { return Ready::Nothing };
        if first.first != next {
            return Ready::Lost;
        }
        let end = batch_end(&st.events, st.largest, start, BATCH);
        let events = &st.events[start..end];
        let last = &events[events.len() - 1];
        Ready::Chunk(Built {
            chunk: encoding.frame(events),
            events: events.len(),
            next: last.last + 1,
            sealed: last.is_sealed(),
            more: end < st.events.len(),
        })
    }
}

/// A round's writes to `buffer`'s parked streams: all of them, or those of the phases due in a
/// share of `k` (see `pacing.rs`). A round of many streams is shared out among the runtime's
/// workers (one part here, the others spawned, at most [`PART`] each), so its writes use every
/// core as the watchers' own tasks would.
/// Unless the deltas are paced (`TurnBuffer::paced`) a round comes with every event of a burst,
/// and writing each one to each socket would cost a write per event where woken tasks batch the
/// burst: the streams go back to their tasks instead.
pub(super) fn write_round(buffer: &Arc<TurnBuffer>, phases: Option<(u32, [bool; PHASES])>) {
    let streams = buffer.attached().due(phases);
    if streams.is_empty() {
        return;
    }
    if !buffer.paced() {
        for stream in &streams {
            stream.release();
        }
        return;
    }
    let workers = match tokio::runtime::Handle::try_current() {
        Ok(runtime) if streams.len() > SHARED_PAST => Some((runtime.metrics().num_workers(), runtime)),
        _ => None,
    };
    let Some((workers, runtime)) = workers.filter(|(workers, _)| *workers > 1) else {
        return write(buffer, &streams);
    };
    let mut parts = streams.chunks(streams.len().div_ceil(workers).min(PART));
    let here = parts.next().unwrap_or_default();
    for part in parts {
        let (buffer, part) = (buffer.clone(), part.to_vec());
        runtime.spawn(async move { write(&buffer, &part) });
    }
    // A task spawned on a worker waits in that worker's LIFO slot, which no other worker
    // steals, until the spawner is done: the last part would run after this one, on this core.
    // A spawn after it moves it to the worker's queue and wakes an idle worker to take it.
    runtime.spawn(async {});
    write(buffer, here);
}

fn write(buffer: &TurnBuffer, streams: &[Arc<ParkedStream>]) {
    // Real time, not tokio's (which tests pause): what the writes cost is what the window follows.
    let start = std::time::Instant::now();
    let mut chunks = Chunks::default();
    let writes = streams.iter().filter(|stream| stream.pump(buffer, &mut chunks)).count();
    buffer.flush.measured(start.elapsed(), writes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_is_found_by_index_or_by_search_alike() {
        let event = |first, last| Arc::new(EncodedEvent::build("t", first, last, Kind::Other, b"{}"));
        let dense: Vec<_> = (0..5).map(|i| event(i, i)).collect();
        // After coalescing: events 0, 1-3, 4, 5-8, 9.
        let sparse = vec![event(0, 0), event(1, 3), event(4, 4), event(5, 8), event(9, 9)];
        for events in [&dense, &sparse, &Vec::new()] {
            for next in 0..12 {
                assert_eq!(start_of(events, next), events.partition_point(|f| f.last < next), "next {next}");
            }
        }
    }

    #[test]
    fn a_batch_ends_at_its_count_or_its_bytes() {
        let event = |i: u32, size: usize| {
            Arc::new(EncodedEvent::build("t", i, i, Kind::Other, format!("\"{}\"", "x".repeat(size)).as_bytes()))
        };
        let small: Vec<_> = (0..300).map(|i| event(i, 10)).collect();
        let largest = small.iter().map(|f| f.line.len()).max().unwrap();
        assert_eq!(batch_end(&small, largest, 0, BATCH), BATCH);
        assert_eq!(batch_end(&small, largest, 250, BATCH), 300);
        let large: Vec<_> = (0..10).map(|i| event(i, 100_000)).collect();
        let largest = large.iter().map(|f| f.line.len()).max().unwrap();
        assert_eq!(batch_end(&large, largest, 0, BATCH), 3, "three lines of 100 KB pass 256 KiB");
        assert_eq!(batch_end(&large, largest, 9, BATCH), 10);
        let huge = vec![event(0, 1_000_000), event(1, 10)];
        assert_eq!(batch_end(&huge, 1_000_003, 0, BATCH), 1, "at least one event");
    }
}
