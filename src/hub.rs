//! Fan-out of turn events: per-conversation replay buffers that every transport reads from.
//!
//! A turn publishes into its [`TurnBuffer`]; each event is framed once (an NDJSON line and an
//! SSE message, both shared [`Bytes`]; the WebSocket message on first use). Watchers do not get
//! a queue of their own: a [`Cursor`] is a position in the buffer, so a watcher that falls
//! behind reads further back (lossless, in order, batched into one write), and a turn never
//! waits for anyone.
//!
//! Turns of one conversation form a chain: each buffer holds the slot its successor will be
//! placed in, so a watcher still reading turn N finds turn N+1 even if that one has already
//! sealed. The hub keeps only the buffer of the turn in flight; a sealed buffer lives on only
//! while some watcher still reads it.
//!
//! Wake-ups: a turn wakes its waiting watchers in rounds. Under light load every event starts a
//! round at once. A round costs about one socket write per watcher, so when many watchers read
//! in-flight turns, runs of deltas are paced: a turn starts a round of delta wake-ups about once
//! per flush window, and the deltas published in between share the next round (and so one
//! write per watcher); the round starts early once as many deltas wait as a window of this
//! turn usually gathers (see `TurnBuffer::wake`). The window is [`FlushWindow::per_reader`] times the number of watchers
//! reading in-flight turns across the hub, up to [`FlushWindow::max`], and zero below 1 ms (the timer's
//! resolution): the hub aims to spend a bounded share of a core on wake-ups and writes whatever
//! the fan-out, and adds no delay when there is little to share. Every event other than a delta
//! starts a round at once, taking the pending deltas with it. A round also writes to the sockets
//! of parked watchers itself ([`Sink`]): those are not woken at all. When a window gathers a few
//! deltas, parked watchers are staggered in phases, one phase's round per delta, so that a
//! round's writes are spread over the window rather than bunched at its end.
//!
//! Memory: past a per-turn cap, runs of consecutive text (or reasoning) deltas in the buffer are
//! coalesced into one event with the joined text, so a late joiner still rebuilds the exact
//! text. A watcher whose position fell inside a coalesced run is told so ([`Delivery::Lost`])
//! and starts the turn over from its (coalesced) beginning.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::wire::{AgentEvent, TurnReasoningDeltaEvent, TurnTextDeltaEvent};

mod sink;
pub use sink::{Framed, Sink, Unparked, WS_CLOSE, WS_PING, WS_PONG, WS_TEXT, chunk_size, put_ws_frame, ws_frame_len};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Reasoning,
    Sealed,
    Other,
}

/// One event (or a coalesced run of deltas), framed once for every transport.
#[derive(Debug)]
pub struct Frame {
    /// 0-based index of the (first) event in its turn.
    pub first: u32,
    /// Index of the last event this frame stands for (`first` unless coalesced). The SSE id is
    /// `<turnId>:<last>`, so resuming after it is exact.
    pub last: u32,
    kind: Kind,
    /// The JSON object followed by `\n`.
    pub line: Bytes,
    /// `id: <turnId>:<last>\ndata: <json>\n\n`.
    pub sse: Bytes,
    /// `{"type":"chat.delta","event":<json>}`, built the first time a WebSocket needs it (as
    /// text checked once, so sending it to every socket checks nothing).
    ws: OnceLock<axum::extract::ws::Utf8Bytes>,
}

impl Frame {
    fn new(turn_id: &str, first: u32, last: u32, event: &AgentEvent) -> Frame {
        let (kind, json) = Frame::encode(event);
        Frame::build(turn_id, first, last, kind, &json)
    }

    /// The event's kind and JSON: the part of framing that needs no index (done outside the
    /// buffer's lock).
    fn encode(event: &AgentEvent) -> (Kind, Vec<u8>) {
        let kind = match event {
            AgentEvent::TextDelta(_) => Kind::Text,
            AgentEvent::ReasoningDelta(_) => Kind::Reasoning,
            AgentEvent::TurnSealed(_) => Kind::Sealed,
            _ => Kind::Other,
        };
        (kind, serde_json::to_vec(event).expect("wire types always serialize"))
    }

    fn build(turn_id: &str, first: u32, last: u32, kind: Kind, json: &[u8]) -> Frame {
        let mut line = BytesMut::with_capacity(json.len() + 1);
        line.put_slice(json);
        line.put_u8(b'\n');
        let mut sse = BytesMut::with_capacity(json.len() + turn_id.len() + 24);
        sse.put_slice(b"id: ");
        sse.put_slice(turn_id.as_bytes());
        sse.put_u8(b':');
        sse.put_slice(last.to_string().as_bytes());
        sse.put_slice(b"\ndata: ");
        sse.put_slice(json);
        sse.put_slice(b"\n\n");
        Frame { first, last, kind, line: line.freeze(), sse: sse.freeze(), ws: OnceLock::new() }
    }

    /// The event wrapped as a WebSocket `chat.delta` message.
    pub fn ws(&self) -> &axum::extract::ws::Utf8Bytes {
        self.ws.get_or_init(|| {
            // The line is JSON serialized by serde_json: UTF-8 by construction.
            let json = std::str::from_utf8(&self.line[..self.line.len() - 1]).unwrap_or_default();
            let mut out = String::with_capacity(json.len() + 32);
            out.push_str(r#"{"type":"chat.delta","event":"#);
            out.push_str(json);
            out.push('}');
            out.into()
        })
    }

    /// True for `turn-sealed`, the last frame of a turn.
    pub fn is_sealed(&self) -> bool {
        self.kind == Kind::Sealed
    }

    fn size(&self) -> usize {
        // The WebSocket copy is about one line long once built; count it up front.
        2 * self.line.len() + self.sse.len() + std::mem::size_of::<Frame>()
    }

    /// The delta text of a text or reasoning frame.
    fn delta(&self) -> Option<String> {
        match serde_json::from_slice::<AgentEvent>(&self.line).ok()? {
            AgentEvent::TextDelta(e) => Some(e.delta),
            AgentEvent::ReasoningDelta(e) => Some(e.delta),
            _ => None,
        }
    }
}

/// How long paced deltas may wait for their round (see the module documentation): a trade of
/// latency for CPU that an operator may move either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushWindow {
    /// The window per watcher reading an in-flight turn.
    pub per_reader: Duration,
    /// The longest window.
    pub max: Duration,
}

/// The configuration's defaults (`--flush-us-per-watcher`, `--flush-max-ms`), for tests; the
/// gateway builds its window from the configuration.
#[cfg(test)]
impl Default for FlushWindow {
    fn default() -> FlushWindow {
        FlushWindow { per_reader: Duration::from_micros(16), max: Duration::from_millis(40) }
    }
}

impl FlushWindow {
    /// The window with `readers` watchers reading in-flight turns.
    fn for_readers(&self, readers: usize) -> Duration {
        let window = self.per_reader.saturating_mul(readers.min(u32::MAX as usize) as u32);
        if window < Duration::from_millis(1) { Duration::ZERO } else { window.min(self.max) }
    }
}

/// Most phases a turn's parked watchers are staggered into (see `TurnBuffer::wake`).
const PHASES: usize = 8;

/// When a turn last woke its watchers, how its deltas are spaced, how its parked watchers are
/// staggered, and when a round of everyone is due.
#[derive(Default)]
struct Pacing {
    /// The last round, of every watcher or of one phase.
    last_round: Option<Instant>,
    /// Deltas since the last round of every watcher.
    deltas: u32,
    last_delta: Option<Instant>,
    /// The usual interval between the turn's deltas (a moving average).
    spacing: Option<Duration>,
    /// Deltas per write at the last delta (see [`Pacing::share`]).
    share: u32,
    /// The share the phases are laid out for (0: not staggered).
    phases: u32,
    /// Per phase, the delta (counted as in `deltas`) with which it writes next.
    next_write: [u32; PHASES],
    /// Per phase, when the oldest delta it has not been written was published.
    unsent_since: [Option<Instant>; PHASES],
    /// When the first delta since the last round of everyone was published.
    first_delta: Option<Instant>,
    /// When a round of every watcher is due unless deltas start rounds first.
    deadline: Option<Instant>,
    /// Where the timer task sleeps to, if one does.
    timer: Option<Instant>,
}

impl Pacing {
    fn delta_at(&mut self, now: Instant) {
        if let Some(last) = self.last_delta {
            let gap = now - last;
            self.spacing = Some(self.spacing.map_or(gap, |s| (s * 7 + gap) / 8));
        }
        self.last_delta = Some(now);
    }

    /// How long after the window's end a round of everyone waits for the share the window
    /// usually gathers: half a spacing.
    fn slack(&self) -> Duration {
        self.spacing.unwrap_or_default() / 2
    }

    /// How many deltas a window of `window` usually gathers (at least two; unbounded while
    /// the deltas come all at once): the deltas one write per watcher carries. Phases laid out
    /// for a share of k keep it while the window is between k - 1/4 and k + 5/4 spacings (laying
    /// them out again costs a round of everyone); the first delta of a share then still waits
    /// less than the window.
    fn share(&mut self, window: Duration) -> u32 {
        self.share = match self.spacing {
            Some(spacing) if !spacing.is_zero() => {
                let ratio = window.as_secs_f64() / spacing.as_secs_f64();
                let kept = f64::from(self.phases);
                if self.phases != 0 && ratio >= kept - 0.25 && ratio < kept + 1.25 {
                    self.phases
                } else {
                    (window.as_nanos() / spacing.as_nanos()).clamp(2, u32::MAX.into()) as u32
                }
            }
            _ => u32::MAX,
        };
        self.share
    }

    /// Lays the phases out for the current share, the first to write with the next delta
    /// (with this one, `now`, when deltas already wait), then one per delta in turn.
    fn lay_out_phases(&mut self) {
        self.phases = if (2..=PHASES as u32).contains(&self.share) { self.share } else { 0 };
        let k = self.phases as usize;
        let from = self.deltas.saturating_sub(1);
        for p in 0..k {
            self.next_write[p] = from + ((p + k - 1) % k) as u32 + 1;
            self.unsent_since[p] = self.first_delta;
        }
    }
}

/// Where the next turn of a conversation will appear.
#[derive(Default)]
struct TurnSlot {
    turn: OnceLock<Arc<TurnBuffer>>,
    filled: Notify,
}

#[derive(Default)]
struct BufferState {
    frames: Vec<Arc<Frame>>,
    /// Index the next published event gets.
    next_index: u32,
    bytes: usize,
    /// Coalesce when `bytes` passes this (the cap, raised after each pass so that passes are
    /// at least half a cap of new events apart).
    threshold: usize,
    sealed: bool,
}

/// The replay buffer of one turn: every event from `user-message` on.
pub struct TurnBuffer {
    pub conversation_id: Arc<str>,
    pub turn_id: Arc<str>,
    cap: usize,
    state: RwLock<BufferState>,
    grown: Notify,
    pacing: Mutex<Pacing>,
    /// Watchers reading in-flight turns, hub-wide.
    readers: Arc<AtomicUsize>,
    /// Bytes held by every live buffer, hub-wide.
    held: Arc<AtomicUsize>,
    flush: FlushWindow,
    next: Arc<TurnSlot>,
    /// Streams a round writes to itself while they are parked (see [`Sink`]).
    sinks: Mutex<Attached>,
}

/// The sinks attached to a turn, each with its phase (see `TurnBuffer::wake`).
#[derive(Default)]
struct Attached {
    sinks: Vec<(u32, Arc<Sink>)>,
    /// The phase the next sink gets: sinks take the phases in turn.
    next_phase: u32,
}

impl Drop for TurnBuffer {
    fn drop(&mut self) {
        let bytes = self.state.get_mut().unwrap_or_else(|p| p.into_inner()).bytes;
        self.held.fetch_sub(bytes, Relaxed);
    }
}

impl TurnBuffer {
    /// Frames the event once, appends it, and wakes every reader waiting at the end.
    /// Returns the event's index in the turn.
    pub fn publish(self: &Arc<Self>, event: &AgentEvent) -> u32 {
        let (index, paced) = self.append(event, false);
        self.wake(paced);
        index
    }

    /// Frames and appends the event; its index, and whether its round may be paced.
    fn append(&self, event: &AgentEvent, last: bool) -> (u32, bool) {
        let (kind, json) = Frame::encode(event);
        let paced = matches!(kind, Kind::Text | Kind::Reasoning) && !last;
        let index = {
            let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
            let index = st.next_index;
            let frame = Arc::new(Frame::build(&self.turn_id, index, index, kind, &json));
            st.next_index += 1;
            st.bytes += frame.size();
            self.held.fetch_add(frame.size(), Relaxed);
            st.frames.push(frame);
            st.sealed = last;
            if st.bytes > st.threshold {
                self.coalesce(&mut st);
            }
            index
        };
        (index, paced)
    }

    /// The flush window for paced deltas right now.
    fn window(&self) -> Duration {
        self.flush.for_readers(self.readers.load(Relaxed))
    }

    /// Whether deltas are paced now (the window is open): only then may a watcher park, since
    /// only then does a round carry what a window gathered instead of every single event.
    pub fn paced(&self) -> bool {
        !self.window().is_zero()
    }

    fn pacing(&self) -> std::sync::MutexGuard<'_, Pacing> {
        self.pacing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the waiting watchers now, or (a paced delta within the window of the last round)
    /// lets it wait for a later round.
    ///
    /// A round does not wait for the window's end once as many deltas wait as a window of this
    /// turn usually gathers (its *share*): it would carry no more, and each waits less (deltas
    /// 20 ms apart under a 40 ms window go out in pairs as the second one comes, instead of
    /// waiting 20 and 40 ms for a timer that may just miss the second).
    ///
    /// With a share of a few deltas, parked watchers are staggered: they are laid out in as many
    /// phases as the share, and each delta starts the round of one phase. Every watcher still
    /// gets one write per share of deltas, and no delta waits longer, but a round writes to a
    /// share's fraction of the sockets instead of all of them at once, so the last socket of a
    /// round is written that much sooner. Woken tasks are phase 0. A delta that does not come
    /// in time (the timer: the window and half a spacing after the oldest delta some phase has
    /// not been sent) or any other event starts a round of everyone, after which the phases
    /// start over.
    fn wake(self: &Arc<Self>, paced: bool) {
        let window = if paced { self.window() } else { Duration::ZERO };
        let now = Instant::now();
        let mut pacing = self.pacing();
        if window.is_zero() {
            return self.round_now(pacing, now);
        }
        pacing.delta_at(now);
        if pacing.last_round.is_none_or(|last| now >= last + window) {
            return self.round_now(pacing, now);
        }
        let share = pacing.share(window);
        pacing.deltas += 1;
        let deltas = pacing.deltas;
        if deltas == 1 {
            pacing.first_delta = Some(now);
        }
        if pacing.phases != 0 || (2..=PHASES as u32).contains(&share) {
            if share != pacing.phases {
                if pacing.phases != 0 {
                    // Phases laid out for another share: everyone now, and they start over.
                    return self.round_now(pacing, now);
                }
                // Every round since the last of everyone was one of everyone: lay the phases
                // out as if from that one.
                pacing.lay_out_phases();
            }
            return self.phase_round(pacing, now, window);
        }
        if deltas >= share {
            return self.round_now(pacing, now);
        }
        if deltas == 1 {
            // Half a spacing more, so that a share gathered on time starts the round itself
            // rather than racing the timer to it.
            let due = pacing.last_round.map(|last| last + window + pacing.slack());
            if !due.is_some_and(|due| self.arm(&mut pacing, due)) {
                self.round_now(pacing, now);
            }
        }
    }

    /// The round of the phases that write with the `deltas`th delta.
    fn phase_round(self: &Arc<Self>, mut pacing: std::sync::MutexGuard<'_, Pacing>, now: Instant, window: Duration) {
        let (k, c) = (pacing.phases as usize, pacing.deltas);
        let mut due = [false; PHASES];
        let mut oldest: Option<Instant> = None;
        let Pacing { next_write, unsent_since, .. } = &mut *pacing;
        for ((next, unsent), due) in next_write.iter_mut().zip(unsent_since).zip(&mut due).take(k) {
            if c >= *next {
                *next = c + k as u32;
                *unsent = None;
                *due = true;
            } else {
                let since = *unsent.get_or_insert(now);
                oldest = Some(oldest.map_or(since, |o| o.min(since)));
            }
        }
        pacing.last_round = Some(now);
        match oldest {
            Some(since) => {
                let at = since + window + pacing.slack();
                if !self.arm(&mut pacing, at) {
                    return self.round_now(pacing, now);
                }
            }
            None => pacing.deadline = None,
        }
        drop(pacing);
        if due[0] {
            self.grown.notify_waiters();
        }
        self.pump_sinks(Some((k as u32, due)));
    }

    /// Makes sure a round of everyone starts at `at` unless one starts before; false without
    /// a runtime to time it.
    fn arm(self: &Arc<Self>, pacing: &mut Pacing, at: Instant) -> bool {
        pacing.deadline = Some(at);
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
                        return buffer.round_now(pacing, Instant::now());
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

    /// Starts a round of everyone now: wakes every waiting watcher and writes to every parked one.
    fn round_now(self: &Arc<Self>, mut pacing: std::sync::MutexGuard<'_, Pacing>, now: Instant) {
        pacing.last_round = Some(now);
        pacing.deltas = 0;
        pacing.first_delta = None;
        pacing.deadline = None;
        pacing.lay_out_phases();
        drop(pacing);
        self.grown.notify_waiters();
        self.pump_sinks(None);
    }

    /// Merges every run of two or more consecutive same-kind deltas into one frame.
    fn coalesce(&self, st: &mut BufferState) {
        let before = st.bytes;
        let mut out: Vec<Arc<Frame>> = Vec::with_capacity(st.frames.len());
        let mut run: Vec<Arc<Frame>> = Vec::new();
        let flush = |run: &mut Vec<Arc<Frame>>, out: &mut Vec<Arc<Frame>>| {
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
            out.push(Arc::new(Frame::new(&self.turn_id, first, last, &event)));
            run.clear();
        };
        for frame in st.frames.drain(..) {
            let joins =
                matches!(frame.kind, Kind::Text | Kind::Reasoning) && run.last().is_none_or(|r| r.kind == frame.kind);
            if !joins {
                flush(&mut run, &mut out);
            }
            if matches!(frame.kind, Kind::Text | Kind::Reasoning) {
                run.push(frame);
            } else {
                out.push(frame);
            }
        }
        flush(&mut run, &mut out);
        st.frames = out;
        st.bytes = st.frames.iter().map(|f| f.size()).sum();
        // The change, either way (the atomic add wraps like the subtraction).
        self.held.fetch_add(st.bytes.wrapping_sub(before), Relaxed);
        st.threshold = self.cap.max(st.bytes + self.cap / 2);
        tracing::debug!(turn = %self.turn_id, before, after = st.bytes, "coalesced the replay buffer");
    }

    /// Bytes held by the frames of this turn.
    pub fn bytes(&self) -> usize {
        self.state.read().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// Number of events published so far.
    pub fn published(&self) -> u32 {
        self.state.read().unwrap_or_else(|p| p.into_inner()).next_index
    }
}

/// What a cursor hands out next.
#[derive(Debug)]
pub enum Delivery {
    /// Frames in order, all from one turn.
    Frames(Vec<Arc<Frame>>),
    /// The cursor's position was coalesced away; it now reads its turn from the beginning.
    Lost,
    /// A single-turn cursor has delivered `turn-sealed`.
    End,
}

/// A cursor's hold on the turn it reads, counted in the hub's total of readers while the turn
/// is in flight (the flush window grows with it).
struct Reader {
    buffer: Arc<TurnBuffer>,
    counted: bool,
}

impl Reader {
    fn new(buffer: Arc<TurnBuffer>) -> Reader {
        buffer.readers.fetch_add(1, Relaxed);
        Reader { buffer, counted: true }
    }

    /// Stops counting once the turn has sealed: nothing more is paced in it.
    fn sealed(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.buffer.readers.fetch_sub(1, Relaxed);
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.sealed();
    }
}

enum Position {
    /// Reading a turn; `next` is the index of the next event to hand out.
    Reading {
        buffer: Reader,
        next: u32,
    },
    /// Caught up with every turn so far; waiting for the next one to begin.
    Waiting(Arc<TurnSlot>),
    Done,
}

/// A watcher's position in a conversation's stream of turns.
pub struct Cursor {
    at: Position,
    /// Go on to later turns after `turn-sealed` (a conversation watcher), or stop (one turn).
    follow: bool,
    /// Lets the hub forget an idle conversation once its last watcher leaves.
    release: Option<(Arc<Hub>, Arc<str>)>,
}

impl Cursor {
    /// The turn this cursor reads and the index of the next event it hands out (`None` while it
    /// waits for a turn to begin, or has ended).
    pub fn reading(&self) -> Option<(&Arc<TurnBuffer>, u32)> {
        match &self.at {
            Position::Reading { buffer, next } => Some((&buffer.buffer, *next)),
            _ => None,
        }
    }

    /// Moves the position within the turn being read to event `next` (where a [`Sink`] that
    /// wrote for this cursor left off).
    pub fn seek(&mut self, to: u32) {
        if let Position::Reading { next, .. } = &mut self.at {
            *next = to;
        }
    }

    /// What is available right now, without waiting (`None` when nothing is).
    pub fn try_batch(&mut self, max: usize) -> Option<Delivery> {
        use futures_util::FutureExt;
        self.next_batch(max).now_or_never()
    }

    /// Waits until something is available, then returns every available frame up to `max`.
    /// Cancel-safe: the position only moves when frames are returned.
    pub async fn next_batch(&mut self, max: usize) -> Delivery {
        loop {
            match &mut self.at {
                Position::Done => return Delivery::End,
                Position::Waiting(slot) => {
                    let slot = slot.clone();
                    let filled = slot.filled.notified();
                    tokio::pin!(filled);
                    filled.as_mut().enable();
                    if let Some(buffer) = slot.turn.get() {
                        self.at = Position::Reading { buffer: Reader::new(buffer.clone()), next: 0 };
                        continue;
                    }
                    filled.await;
                }
                Position::Reading { buffer: reader, next } => {
                    let buffer = reader.buffer.clone();
                    // Created before the state is read, so no round after that read is missed
                    // (`notify_waiters` reaches a `Notified` from its creation on). It joins the
                    // waiters' list, under the lock every round takes, only if it is awaited:
                    // under load there is usually something to read at once.
                    let grown = buffer.grown.notified();
                    let (batch, at_end) = {
                        let st = buffer.state.read().unwrap_or_else(|p| p.into_inner());
                        let start = start_of(&st.frames, *next);
                        if st.frames.get(start).is_some_and(|f| f.first < *next) {
                            *next = 0;
                            return Delivery::Lost;
                        }
                        let end = st.frames.len().min(start.saturating_add(max));
                        let batch: Vec<Arc<Frame>> = st.frames[start..end].to_vec();
                        if st.sealed {
                            reader.sealed();
                        }
                        (batch, st.sealed && end == st.frames.len())
                    };
                    if let Some(last) = batch.last() {
                        *next = last.last + 1;
                    }
                    if at_end {
                        self.at = if self.follow { Position::Waiting(buffer.next.clone()) } else { Position::Done };
                    }
                    if !batch.is_empty() {
                        return Delivery::Frames(batch);
                    }
                    if !at_end {
                        grown.await;
                    }
                }
            }
        }
    }
}

impl Drop for Cursor {
    fn drop(&mut self) {
        if let Some((hub, conversation_id)) = self.release.take() {
            self.at = Position::Done;
            hub.forget_if_unwatched(&conversation_id);
        }
    }
}

/// Where the frames from event index `next` on start: the first frame whose last event is at
/// or past `next`. Until a coalescing pass frame `i` is event `i`, so that place is checked
/// first (two frames, instead of a binary search touching a frame at every step).
fn start_of(frames: &[Arc<Frame>], next: u32) -> usize {
    let i = next as usize;
    if i <= frames.len() && (i == 0 || frames[i - 1].last < next) && frames.get(i).is_none_or(|f| f.last >= next) {
        return i;
    }
    frames.partition_point(|f| f.last < next)
}

/// Concatenates a batch of frames into one buffer, so a batch costs one socket write.
pub fn join_frames(frames: &[Arc<Frame>], framed: Framed) -> Bytes {
    match frames {
        [one] => framed.bytes(one),
        many => {
            let len = many.iter().map(|f| framed.len(f)).sum();
            let mut out = BytesMut::with_capacity(len);
            for f in many {
                framed.put(&mut out, f);
            }
            out.freeze()
        }
    }
}

/// A resume point: the SSE id `<turnId>:<n>` of the last event a watcher holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId {
    pub turn_id: String,
    pub index: u32,
}

impl EventId {
    /// Parses `<turnId>:<n>`; the turn id may itself contain colons.
    pub fn parse(s: &str) -> Option<EventId> {
        let (turn, n) = s.rsplit_once(':')?;
        if turn.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(EventId { turn_id: turn.to_owned(), index: n.parse().ok()? })
    }
}

#[derive(Default)]
struct Channel {
    current: Option<Arc<TurnBuffer>>,
    next: Arc<TurnSlot>,
}

/// The per-conversation channels. The lock is held only for a few pointer moves, never across
/// an `.await`, so a `std` mutex fits.
pub struct Hub {
    channels: Mutex<HashMap<Arc<str>, Channel>>,
    /// Watchers reading in-flight turns.
    readers: Arc<AtomicUsize>,
    /// Bytes held by every live replay buffer (in flight, or sealed and still being read).
    held: Arc<AtomicUsize>,
    /// Per-turn buffer size past which deltas are coalesced.
    buffer_cap: usize,
    flush: FlushWindow,
}

impl Hub {
    pub fn new(buffer_cap: usize, flush: FlushWindow) -> Arc<Hub> {
        Arc::new(Hub { channels: Mutex::default(), readers: Arc::default(), held: Arc::default(), buffer_cap, flush })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Channel>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The flush window for as many watchers as read in-flight turns now: how long a round may
    /// hold what a watcher is due (zero: rounds write every event at once).
    pub fn window(&self) -> Duration {
        self.flush.for_readers(self.readers.load(Relaxed))
    }

    /// Opens the replay buffer of a new turn with its `opening` events already in it, so that
    /// the watchers waiting for the turn wake once and take them in one write (many turns
    /// starting at once would otherwise cost a wake-up and a write per event per watcher). The
    /// caller guarantees one turn at a time per conversation.
    pub fn begin_turn(&self, conversation_id: &str, turn_id: &str, opening: &[AgentEvent]) -> Arc<TurnBuffer> {
        // Built and filled before the hub's lock is taken: nobody can see it until the slot
        // and the channel point at it.
        let buffer = Arc::new(TurnBuffer {
            conversation_id: Arc::from(conversation_id),
            turn_id: Arc::from(turn_id),
            cap: self.buffer_cap,
            state: RwLock::new(BufferState { threshold: self.buffer_cap, ..BufferState::default() }),
            grown: Notify::new(),
            pacing: Mutex::default(),
            readers: self.readers.clone(),
            held: self.held.clone(),
            flush: self.flush,
            next: Arc::default(),
            sinks: Mutex::default(),
        });
        for event in opening {
            buffer.append(event, false);
        }
        let mut channels = self.lock();
        let channel = channels.entry(Arc::from(conversation_id)).or_default();
        let slot = std::mem::replace(&mut channel.next, buffer.next.clone());
        let _ = slot.turn.set(buffer.clone());
        slot.filled.notify_waiters();
        channel.current = Some(buffer.clone());
        buffer
    }

    /// Publishes `turn-sealed` and drops the hub's hold on the buffer in one step, so a watcher
    /// that subscribes afterwards waits for the next turn instead of replaying a sealed one.
    /// The round that carries it runs after the hub's lock is released (it may write to many
    /// sockets).
    pub fn seal_turn(&self, buffer: Arc<TurnBuffer>, sealed: &AgentEvent) {
        let mut channels = self.lock();
        buffer.append(sealed, true);
        let conversation_id = buffer.conversation_id.clone();
        if let Some(channel) = channels.get_mut(&*conversation_id)
            && channel.current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &buffer))
        {
            channel.current = None;
        }
        drop(channels);
        buffer.wake(false);
        drop(buffer);
        Self::collect(&mut self.lock(), &conversation_id);
    }

    /// Reads one turn alone, from its first event to `turn-sealed`.
    pub fn read_turn(self: &Arc<Self>, buffer: &Arc<TurnBuffer>) -> Cursor {
        Cursor {
            at: Position::Reading { buffer: Reader::new(buffer.clone()), next: 0 },
            follow: false,
            release: Some((self.clone(), buffer.conversation_id.clone())),
        }
    }

    /// Subscribes to a conversation: the in-flight turn from its first event (or right after
    /// `resume`, when that names an event of the in-flight turn), then every later turn.
    /// Subscribing and publishing are ordered by the locks, so the watcher sees no gap and no
    /// duplicate. The flag is true when `resume` could not be honoured: the watcher must
    /// refetch history past its cursor (`resync`).
    pub fn subscribe(self: &Arc<Self>, conversation_id: &str, resume: Option<&EventId>) -> (Cursor, bool) {
        let mut channels = self.lock();
        let key: Arc<str> = Arc::from(conversation_id);
        let channel = channels.entry(key.clone()).or_default();
        let mut resync = resume.is_some();
        let at = match &channel.current {
            Some(buffer) => {
                let mut next = 0;
                if let Some(id) = resume
                    && *buffer.turn_id == *id.turn_id
                    && id.index < buffer.published()
                {
                    next = id.index + 1;
                    resync = false;
                }
                Position::Reading { buffer: Reader::new(buffer.clone()), next }
            }
            None => Position::Waiting(channel.next.clone()),
        };
        (Cursor { at, follow: true, release: Some((self.clone(), key)) }, resync)
    }

    /// The in-flight turn of a conversation, if any.
    pub fn current(&self, conversation_id: &str) -> Option<Arc<TurnBuffer>> {
        self.lock().get(conversation_id).and_then(|c| c.current.clone())
    }

    /// Bytes held by every live replay buffer: turns in flight, and sealed turns a watcher is
    /// still reading (each within `--turn-buffer-bytes`, give or take a coalescing pass).
    pub fn buffered_bytes(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// Number of conversations the hub holds state for (idle, unwatched ones are forgotten).
    pub fn channel_count(&self) -> usize {
        self.lock().len()
    }

    fn forget_if_unwatched(&self, conversation_id: &str) {
        Self::collect(&mut self.lock(), conversation_id);
    }

    /// Drops a channel with no turn in flight whose next slot nobody else can reach: no
    /// watcher waits on it and no buffer a watcher still reads points at it.
    fn collect(channels: &mut HashMap<Arc<str>, Channel>, conversation_id: &str) {
        if let Some(channel) = channels.get(conversation_id)
            && channel.current.is_none()
            && Arc::strong_count(&channel.next) == 1
        {
            channels.remove(conversation_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{TurnInputEvent, TurnSealedEvent, TurnStartEvent};

    pub(super) fn text(d: &str) -> AgentEvent {
        AgentEvent::TextDelta(TurnTextDeltaEvent { conversation_id: "c".into(), turn_id: "t".into(), delta: d.into() })
    }

    pub(super) fn sealed() -> AgentEvent {
        AgentEvent::TurnSealed(TurnSealedEvent { conversation_id: "c".into(), turn_id: "t".into() })
    }

    async fn frames(cursor: &mut Cursor) -> Vec<Arc<Frame>> {
        match cursor.next_batch(usize::MAX).await {
            Delivery::Frames(f) => f,
            other => panic!("expected frames, got {other:?}"),
        }
    }

    #[test]
    fn a_position_is_found_by_index_or_by_search_alike() {
        let frame = |first, last| Arc::new(Frame::build("t", first, last, Kind::Other, b"{}"));
        let dense: Vec<_> = (0..5).map(|i| frame(i, i)).collect();
        // After coalescing: events 0, 1-3, 4, 5-8, 9.
        let sparse = vec![frame(0, 0), frame(1, 3), frame(4, 4), frame(5, 8), frame(9, 9)];
        for frames in [&dense, &sparse, &Vec::new()] {
            for next in 0..12 {
                assert_eq!(start_of(frames, next), frames.partition_point(|f| f.last < next), "next {next}");
            }
        }
    }

    #[tokio::test]
    async fn coalescing_keeps_the_text_and_loses_only_positions_inside_a_run() {
        let hub = Hub::new(2_000, FlushWindow::default());
        let buffer = hub.begin_turn("c", "t", &[]);
        buffer.publish(&AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() }));
        let (mut early, _) = hub.subscribe("c", None);
        assert_eq!(frames(&mut early).await.len(), 1);
        let (mut middle, _) = hub.subscribe("c", None);
        for i in 0..40 {
            buffer.publish(&text(&format!("w{i} ")));
            if i == 2 {
                assert_eq!(frames(&mut middle).await.len(), 4);
            }
        }
        assert!(buffer.bytes() <= 2_000 + 1_000, "coalesced: {}", buffer.bytes());
        // `early` stood at the start of the run: it reads on losslessly.
        let got = frames(&mut early).await;
        let joined: String = got.iter().filter_map(|f| f.delta()).collect();
        let expected: String = (0..40).map(|i| format!("w{i} ")).collect();
        assert_eq!(joined, expected);
        // `middle` stood inside the run: it is told, and restarts from the turn's beginning.
        assert!(matches!(middle.next_batch(usize::MAX).await, Delivery::Lost));
        let again = frames(&mut middle).await;
        assert_eq!(again[0].first, 0);
        let joined: String = again.iter().filter_map(|f| f.delta()).collect();
        assert_eq!(joined, expected);
        // The coalesced frame's SSE id names its last event, so resuming after it is exact.
        let last = again.last().unwrap();
        assert!(String::from_utf8_lossy(&last.sse).starts_with(&format!("id: t:{}\n", last.last)));
        assert_eq!(hub.buffered_bytes(), buffer.bytes(), "the hub-wide count follows coalescing");
        hub.seal_turn(buffer, &sealed());
        assert!(frames(&mut early).await[0].is_sealed());
        // A sealed turn's buffer is held while a watcher still reads it, and released after.
        assert!(hub.buffered_bytes() > 0);
        drop((early, middle));
        assert_eq!(hub.buffered_bytes(), 0);
    }

    /// Whether a spawned read has finished, after letting every ready task run.
    async fn finished(task: &tokio::task::JoinHandle<Delivery>) -> bool {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        task.is_finished()
    }

    #[test]
    fn the_flush_window_grows_with_readers_up_to_its_cap_and_is_zero_below_a_millisecond() {
        let flush = FlushWindow { per_reader: Duration::from_micros(20), max: Duration::from_millis(40) };
        assert_eq!(flush.for_readers(49), Duration::ZERO);
        assert_eq!(flush.for_readers(50), Duration::from_millis(1));
        assert_eq!(flush.for_readers(1_000), Duration::from_millis(20));
        assert_eq!(flush.for_readers(1_000_000), Duration::from_millis(40));
        let off = FlushWindow { per_reader: Duration::ZERO, ..flush };
        assert_eq!(off.for_readers(1_000_000), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn with_many_watchers_deltas_wait_for_the_round_and_other_events_go_at_once() {
        let flush = FlushWindow { per_reader: Duration::from_micros(10), ..FlushWindow::default() };
        let hub = Hub::new(1 << 20, flush);
        let buffer = hub.begin_turn("c", "t", &[]);
        // 300 watchers of the turn in flight: a 3 ms window.
        let mut cursors: Vec<Cursor> = (0..300).map(|_| hub.subscribe("c", None).0).collect();
        assert_eq!(buffer.window(), Duration::from_millis(3));
        let start = AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() });
        buffer.publish(&start);
        for c in &mut cursors {
            assert_eq!(frames(c).await.len(), 1);
        }
        let mut waiting = cursors.pop().unwrap();
        let read = tokio::spawn(async move { waiting.next_batch(usize::MAX).await });
        assert!(!finished(&read).await, "nothing to read yet");
        // Two deltas right after a round: the waiting watcher is woken once, at the window's end.
        buffer.publish(&text("a"));
        buffer.publish(&text("b"));
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!finished(&read).await, "woken before the window ended");
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(finished(&read).await, "woken when the window ended");
        match read.await.unwrap() {
            Delivery::Frames(f) => assert_eq!(f.iter().filter_map(|f| f.delta()).collect::<String>(), "ab"),
            other => panic!("{other:?}"),
        }
        // Any other event wakes at once, taking the pending deltas along.
        let mut waiting = cursors.pop().unwrap();
        assert_eq!(frames(&mut waiting).await.len(), 2);
        let read = tokio::spawn(async move { waiting.next_batch(usize::MAX).await });
        assert!(!finished(&read).await);
        buffer.publish(&text("c"));
        assert!(!finished(&read).await, "a delta within the window waits");
        hub.seal_turn(buffer.clone(), &sealed());
        assert!(finished(&read).await, "turn-sealed goes at once");
        match read.await.unwrap() {
            Delivery::Frames(f) => assert!(f.len() == 2 && f[1].is_sealed()),
            other => panic!("{other:?}"),
        }
        // Few watchers: no window at all.
        drop(cursors);
        assert_eq!(buffer.window(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn evenly_spaced_deltas_go_out_as_soon_as_a_window_has_gathered_its_share() {
        // 4,000 watchers of the turn in flight: a 40 ms window; deltas 20 ms apart.
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let buffer = hub.begin_turn("c", "t", &[]);
        let mut cursors: Vec<Cursor> = (0..4_000).map(|_| hub.subscribe("c", None).0).collect();
        assert_eq!(buffer.window(), Duration::from_millis(40));
        let mut watcher = cursors.pop().unwrap();
        let start = Instant::now();
        let reader = tokio::spawn(async move {
            // When each batch arrived (ms since the start) and how many deltas it held.
            let mut got = Vec::new();
            while got.iter().map(|(_, n)| n).sum::<usize>() < 20 {
                let n = frames(&mut watcher).await.len();
                got.push((start.elapsed().as_millis(), n));
            }
            got
        });
        let settle = || async {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        };
        for _ in 0..20 {
            buffer.publish(&text("x"));
            settle().await;
            // Time moves on to the next delta, and whatever timer is due by then runs first.
            tokio::time::advance(Duration::from_millis(20)).await;
            settle().await;
        }
        let got = reader.await.unwrap();
        // Once the turn's spacing is known, each round goes out as the second delta of a pair is
        // published, not when a timer ends the window (which would race that delta and, losing,
        // send the first alone and make the second wait a whole window).
        let steady = &got[2..got.len() - 1];
        assert!(steady.len() >= 8, "{got:?}");
        for (i, (at, n)) in steady.iter().enumerate() {
            assert_eq!((*n, *at), (2, steady[0].0 + 40 * i as u128), "{got:?}");
        }
        drop(cursors);
    }

    #[tokio::test]
    async fn a_turn_opens_with_its_first_events_in_place_and_a_waiting_watcher_takes_them_in_one_batch() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let (mut waiting, _) = hub.subscribe("c", None);
        let read = tokio::spawn(async move { waiting.next_batch(usize::MAX).await });
        tokio::task::yield_now().await;
        assert!(!finished(&read).await, "no turn yet");
        let opening = [
            AgentEvent::UserMessage(TurnInputEvent {
                conversation_id: "c".into(),
                turn_id: "t".into(),
                text: "hi".into(),
            }),
            AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() }),
        ];
        let buffer = hub.begin_turn("c", "t", &opening);
        assert_eq!(buffer.published(), 2);
        match read.await.unwrap() {
            Delivery::Frames(f) => {
                assert_eq!(f.len(), 2, "one wake-up, one batch");
                assert!(f[1].sse.starts_with(b"id: t:1\n"), "{:?}", String::from_utf8_lossy(&f[1].sse));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_watcher_behind_finds_later_turns_even_after_they_sealed() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let (mut watcher, resync) = hub.subscribe("c", None);
        assert!(!resync);
        for turn in ["t1", "t2"] {
            let buffer = hub.begin_turn("c", turn, &[]);
            buffer.publish(&text("x"));
            hub.seal_turn(buffer, &sealed());
        }
        assert_eq!(hub.current("c").map(|b| b.turn_id.to_string()), None);
        let mut seen = Vec::new();
        for _ in 0..2 {
            seen.extend(frames(&mut watcher).await.iter().map(|f| f.first));
        }
        assert_eq!(seen, vec![0, 1, 0, 1]);
        drop(watcher);
        assert_eq!(hub.channel_count(), 0, "an unwatched idle conversation is forgotten");
    }

    #[tokio::test]
    async fn resume_inside_the_turn_in_flight_or_resync() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let buffer = hub.begin_turn("c", "t:x", &[]);
        for i in 0..5 {
            buffer.publish(&text(&i.to_string()));
        }
        let id = EventId::parse("t:x:2").unwrap();
        assert_eq!(id, EventId { turn_id: "t:x".into(), index: 2 });
        let (mut c, resync) = hub.subscribe("c", Some(&id));
        assert!(!resync);
        assert_eq!(frames(&mut c).await.iter().map(|f| f.first).collect::<Vec<_>>(), vec![3, 4]);
        for stale in ["other:1", "t:x:5", "t:x:99"] {
            let (mut c, resync) = hub.subscribe("c", EventId::parse(stale).as_ref());
            assert!(resync, "{stale}");
            assert_eq!(frames(&mut c).await[0].first, 0);
        }
        for bad in ["", "t", "t:", ":1", "t:-1", "t:1.5", "t:99999999999"] {
            assert_eq!(EventId::parse(bad), None, "{bad}");
        }
    }
}
