//! Fan-out of turn events: per-conversation replay buffers that every transport reads from.
//!
//! A turn publishes into its [`TurnBuffer`]; each event is encoded once for every transport
//! ([`EncodedEvent`]). Watchers do not get a queue of their own: a [`Cursor`] is a position in
//! the buffer, so a watcher that falls behind reads further back (lossless, in order, batched
//! into one write), and a turn never waits for anyone. A turn wakes its watchers in rounds,
//! paced under fan-out (`pacing.rs`); a round also writes to the sockets of parked streams
//! itself (`parked.rs`). The hub knows no socket: a transport lends it a [`Socket`] to write to.
//! With several gateways, the hub also meets the others' through a [`Remote`] (`remote.rs`):
//! its own turns go out, and the turns of a conversation watched here that run elsewhere come
//! in as buffers of their own.
//! `docs/streaming.md` explains the rules and their reasons.
//!
//! Turns of one conversation form a chain: each buffer holds the place its successor will take,
//! so a watcher still reading turn N finds turn N+1 even if that one has already sealed. The hub
//! keeps only the buffer of the turn in flight; a sealed buffer lives on only while some watcher
//! still reads it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::wire::AgentEvent;

mod buffer;
mod cursor;
mod pacing;
mod parked;
mod remote;

pub use buffer::{BATCH, TurnBuffer};
pub use cursor::{Cursor, Delivery, EventId};
pub use pacing::{Decision, FlushWindow, PHASES, Pacing, Round};
pub use parked::{Deliveries, ParkedStream, Socket, Unparked};
pub use remote::{Following, Outbox, Outgoing, Remote};

use buffer::NextTurn;

#[derive(Default)]
struct Channel {
    current: Option<Arc<TurnBuffer>>,
    next: Arc<NextTurn>,
    /// The bus's feed of the turns other gateways run here, while someone watches.
    following: Option<Arc<Following>>,
}

/// What replay buffers may hold, in bytes (every framing of every event counted).
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Past this a buffer's runs of deltas are coalesced (`--turn-buffer-bytes`).
    pub coalesce: usize,
    /// Past this, after coalescing, a buffer's oldest events go (`--turn-buffer-max-bytes`).
    pub turn: usize,
    /// Past this over every buffer, the buffer publishing gives up its oldest events
    /// (`--replay-max-bytes`).
    pub total: usize,
}

/// The per-conversation channels. The lock is held only for a few pointer moves, never across
/// an `.await`, so a `std` mutex fits.
pub struct Hub {
    channels: Mutex<HashMap<Arc<str>, Channel>>,
    /// Watchers reading in-flight turns.
    readers: Arc<AtomicUsize>,
    /// Bytes held by every live replay buffer (in flight, or sealed and still being read).
    held: Arc<AtomicUsize>,
    /// What a replay buffer may hold.
    caps: Caps,
    flush: Arc<FlushWindow>,
    remote: Option<Arc<dyn Remote>>,
}

impl Hub {
    /// A hub of one gateway alone, whose buffers coalesce deltas past `buffer_cap` bytes and
    /// are otherwise unbounded (tests).
    pub fn new(buffer_cap: usize, flush: FlushWindow) -> Arc<Hub> {
        Hub::with_remote(Caps { coalesce: buffer_cap, turn: usize::MAX, total: usize::MAX }, flush, None)
    }

    /// A hub that shares turns with other gateways through `remote`.
    pub fn with_remote(caps: Caps, flush: FlushWindow, remote: Option<Arc<dyn Remote>>) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            channels: Mutex::default(),
            readers: Arc::default(),
            held: Arc::default(),
            caps,
            flush: Arc::new(flush),
            remote,
        });
        if let Some(remote) = &hub.remote {
            remote.share_readers(Arc::downgrade(&hub));
        }
        hub
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Channel>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watchers reading in-flight turns here.
    pub fn readers(&self) -> usize {
        self.readers.load(Relaxed)
    }

    /// The other gateways of a cluster have `readers` watchers reading in-flight turns: the
    /// flush window counts them too (`pacing.rs`).
    pub fn set_readers_elsewhere(&self, readers: usize) {
        self.flush.set_elsewhere(readers);
    }

    /// Watchers reading in-flight turns on the cluster's other gateways, as they last said.
    pub fn readers_elsewhere(&self) -> usize {
        self.flush.elsewhere()
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
        let outbox = self.remote.as_ref().map(|r| r.outbox(conversation_id, turn_id, self.caps.coalesce));
        let buffer = self.open(conversation_id, turn_id, opening, outbox);
        // The opening events go out at once, as its watchers here wake for them.
        buffer.to_bus();
        buffer
    }

    /// Opens the buffer of a turn another gateway runs, with the events it has published so
    /// far: its watchers here read it like one of this gateway's.
    pub fn begin_remote_turn(&self, conversation_id: &str, turn_id: &str, opening: &[AgentEvent]) -> Arc<TurnBuffer> {
        self.open(conversation_id, turn_id, opening, None)
    }

    fn open(
        &self,
        conversation_id: &str,
        turn_id: &str,
        opening: &[AgentEvent],
        outbox: Option<Outbox>,
    ) -> Arc<TurnBuffer> {
        // Built and filled before the hub's lock is taken: nobody can see it until the place
        // and the channel point at it.
        let buffer = Arc::new(TurnBuffer::new(
            conversation_id,
            turn_id,
            self.caps,
            self.flush.clone(),
            self.readers.clone(),
            self.held.clone(),
            outbox,
        ));
        for event in opening {
            buffer.append(event, false);
        }
        let mut channels = self.lock();
        let channel = channels.entry(Arc::from(conversation_id)).or_default();
        let next = std::mem::replace(&mut channel.next, buffer.next.clone());
        let _ = next.turn.set(buffer.clone());
        next.filled.notify_waiters();
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
        Cursor::reading(self, buffer, 0, false)
    }

    /// Subscribes to a conversation: the in-flight turn from its first event (or right after
    /// `resume`, when that names an event of the in-flight turn), then every later turn.
    /// Subscribing and publishing are ordered by the locks, so the watcher sees no gap and no
    /// duplicate. The flag is true when `resume` could not be honoured: the watcher must
    /// refetch history past its cursor (`resync`). With other gateways, a conversation not yet
    /// followed here is caught up first (its turn in flight elsewhere, if any, read into the
    /// hub), so a watcher here sees what a watcher of the running gateway sees.
    pub async fn subscribe(self: &Arc<Self>, conversation_id: &str, resume: Option<&EventId>) -> (Cursor, bool) {
        let following = self.catch_up(conversation_id).await;
        let mut channels = self.lock();
        let key: Arc<str> = Arc::from(conversation_id);
        let channel = channels.entry(key.clone()).or_default();
        // Held across the wait, so a collection meanwhile did not end it.
        if channel.following.is_none() {
            channel.following = following;
        }
        let mut resync = resume.is_some();
        let cursor = match &channel.current {
            Some(buffer) => {
                let mut next = 0;
                if let Some(id) = resume
                    && *buffer.turn_id == *id.turn_id
                    && id.index < buffer.published()
                {
                    next = id.index + 1;
                    resync = false;
                }
                Cursor::reading(self, buffer, next, true)
            }
            None => Cursor::waiting(self, key, channel.next.clone()),
        };
        (cursor, resync)
    }

    /// With a bus: follows the conversation (when not yet followed) and waits, bounded, until
    /// its turn in flight elsewhere is in the hub.
    async fn catch_up(self: &Arc<Self>, conversation_id: &str) -> Option<Arc<Following>> {
        let following = self.follow(conversation_id)?;
        if let Some(remote) = &self.remote {
            following.caught_up(remote.catch_up_timeout()).await;
        }
        Some(following)
    }

    /// The conversation's feed from the bus (started when it has none); none without a bus.
    fn follow(self: &Arc<Self>, conversation_id: &str) -> Option<Arc<Following>> {
        let remote = self.remote.as_ref()?;
        let mut channels = self.lock();
        let key: Arc<str> = Arc::from(conversation_id);
        let channel = channels.entry(key.clone()).or_default();
        let following =
            channel.following.get_or_insert_with(|| Arc::new(remote.follow(Arc::downgrade(self), key))).clone();
        Some(following)
    }

    /// The in-flight turn of a conversation, if any, on this gateway or (caught up from the
    /// bus) another.
    pub async fn current(self: &Arc<Self>, conversation_id: &str) -> Option<Arc<TurnBuffer>> {
        let following = self.catch_up(conversation_id).await;
        let mut channels = self.lock();
        let current = channels.get(conversation_id).and_then(|c| c.current.clone());
        drop(following);
        // Nobody watches: a feed started for this question ends with it (or with the turn).
        Self::collect(&mut channels, conversation_id);
        current
    }

    /// What a round's write to one socket costs, as the rounds measure it (see [`FlushWindow`]).
    pub fn write_cost(&self) -> Duration {
        self.flush.write_cost()
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

    /// Drops a channel with no turn in flight whose next turn's place nobody else can reach: no
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
    use tokio::time::Instant;

    use super::*;
    use crate::encoding::EncodedEvent;
    use crate::wire::{TurnInputEvent, TurnSealedEvent, TurnStartEvent, TurnTextDeltaEvent};

    pub(super) fn text(d: &str) -> AgentEvent {
        AgentEvent::TextDelta(TurnTextDeltaEvent { conversation_id: "c".into(), turn_id: "t".into(), delta: d.into() })
    }

    pub(super) fn sealed() -> AgentEvent {
        AgentEvent::TurnSealed(TurnSealedEvent { conversation_id: "c".into(), turn_id: "t".into() })
    }

    async fn frames(cursor: &mut Cursor) -> Vec<Arc<EncodedEvent>> {
        match cursor.next_batch(usize::MAX).await {
            Delivery::Events(f) => f,
            other => panic!("expected frames, got {other:?}"),
        }
    }

    fn tool_result(i: usize, size: usize) -> AgentEvent {
        AgentEvent::ToolResult(crate::wire::TurnToolResultEvent {
            conversation_id: "c".into(),
            turn_id: "t".into(),
            step_id: "t#0".into(),
            tool_call_id: format!("call_{i}"),
            tool_name: "read".into(),
            content: "x".repeat(size),
            is_error: false,
            duration_ms: None,
        })
    }

    /// Events that do not coalesce (tool results) are held within the buffer's hard cap and the
    /// hub's total: the oldest go, and a watcher whose position went with them is told (and
    /// reads on from the first event still held), while one at the front reads every event.
    #[tokio::test]
    async fn a_buffer_past_its_cap_gives_up_its_oldest_events() {
        let caps = Caps { coalesce: 1 << 20, turn: 100_000, total: usize::MAX };
        let hub = Hub::with_remote(caps, FlushWindow::default(), None);
        let buffer = hub.begin_turn("c", "t", &[]);
        let (mut behind, _) = hub.subscribe("c", None).await;
        let (mut front, _) = hub.subscribe("c", None).await;
        let mut seen = 0;
        for i in 0..60 {
            buffer.publish(&tool_result(i, 10_000));
            assert!(buffer.bytes() <= 100_000 + 40_000, "{} bytes after {i}", buffer.bytes());
            seen += frames(&mut front).await.len();
        }
        assert_eq!(seen, 60, "a watcher that keeps up loses nothing");
        assert_eq!(hub.buffered_bytes(), buffer.bytes());
        assert!(matches!(behind.next_batch(usize::MAX).await, Delivery::Lost { .. }));
        let rest = frames(&mut behind).await;
        assert!(rest[0].first > 0 && rest.last().unwrap().last == 59, "from the first held on: {}", rest[0].first);

        // Over the hub's total, the buffer publishing gives up its oldest.
        let caps = Caps { coalesce: 1 << 20, turn: usize::MAX, total: 50_000 };
        let hub = Hub::with_remote(caps, FlushWindow::default(), None);
        let buffer = hub.begin_turn("c", "t", &[]);
        for i in 0..30 {
            buffer.publish(&tool_result(i, 10_000));
            assert!(hub.buffered_bytes() <= 50_000 + 40_000, "{} bytes after {i}", hub.buffered_bytes());
        }
    }

    #[tokio::test]
    async fn coalescing_keeps_the_text_and_loses_only_positions_inside_a_run() {
        let hub = Hub::new(2_000, FlushWindow::default());
        let buffer = hub.begin_turn("c", "t", &[]);
        buffer.publish(&AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() }));
        let (mut early, _) = hub.subscribe("c", None).await;
        assert_eq!(frames(&mut early).await.len(), 1);
        let (mut middle, _) = hub.subscribe("c", None).await;
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
        assert!(matches!(middle.next_batch(usize::MAX).await, Delivery::Lost { .. }));
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

    #[tokio::test(start_paused = true)]
    async fn with_many_watchers_deltas_wait_for_the_round_and_other_events_go_at_once() {
        // Two sweeps (no round has measured a write: 4 us each, on this test's one worker).
        let hub = Hub::new(1 << 20, FlushWindow::new(2, Duration::from_millis(40)));
        let buffer = hub.begin_turn("c", "t", &[]);
        // 375 watchers of the turn in flight: a 3 ms window.
        let mut cursors: Vec<Cursor> = Vec::new();
        for _ in 0..375 {
            cursors.push(hub.subscribe("c", None).await.0);
        }
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
            Delivery::Events(f) => assert_eq!(f.iter().filter_map(|f| f.delta()).collect::<String>(), "ab"),
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
            Delivery::Events(f) => assert!(f.len() == 2 && f[1].is_sealed()),
            other => panic!("{other:?}"),
        }
        // Few watchers: no window at all.
        drop(cursors);
        assert_eq!(buffer.window(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn evenly_spaced_deltas_go_out_as_soon_as_a_window_has_gathered_its_share() {
        // 4,000 watchers of the turn in flight under a 40 ms cap: a 40 ms window; deltas 20 ms
        // apart.
        let hub = Hub::new(1 << 20, FlushWindow::new(4, Duration::from_millis(40)));
        let buffer = hub.begin_turn("c", "t", &[]);
        let mut cursors: Vec<Cursor> = Vec::new();
        for _ in 0..4_000 {
            cursors.push(hub.subscribe("c", None).await.0);
        }
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
        let (mut waiting, _) = hub.subscribe("c", None).await;
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
            Delivery::Events(f) => {
                assert_eq!(f.len(), 2, "one wake-up, one batch");
                assert!(f[1].sse.starts_with(b"id: t:1\n"), "{:?}", String::from_utf8_lossy(&f[1].sse));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_watcher_behind_finds_later_turns_even_after_they_sealed() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let (mut watcher, resync) = hub.subscribe("c", None).await;
        assert!(!resync);
        for turn in ["t1", "t2"] {
            let buffer = hub.begin_turn("c", turn, &[]);
            buffer.publish(&text("x"));
            hub.seal_turn(buffer, &sealed());
        }
        assert_eq!(hub.current("c").await.map(|b| b.turn_id.to_string()), None);
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
        let (mut c, resync) = hub.subscribe("c", Some(&id)).await;
        assert!(!resync);
        assert_eq!(frames(&mut c).await.iter().map(|f| f.first).collect::<Vec<_>>(), vec![3, 4]);
        for stale in ["other:1", "t:x:5", "t:x:99"] {
            let (mut c, resync) = hub.subscribe("c", EventId::parse(stale).as_ref()).await;
            assert!(resync, "{stale}");
            assert_eq!(frames(&mut c).await[0].first, 0);
        }
    }
}
