//! Following a conversation from the stream: the turns other gateways run in it, fed into this
//! gateway's hub with the same event indices, so its watchers read them from one local buffer.
//!
//! A conversation is followed from its last `open` message (the start of its latest turn) with
//! one ordered consumer. What comes before the consumer has caught up (nothing pending) is
//! gathered: a turn that ended in it is history, not replay; a turn still open becomes the
//! hub's in-flight buffer at once with everything it has published. From then on each message
//! goes straight into the hub. A turn with events missing waits for its gateway to send it again
//! (`publish.rs`), read like a message read again: only what is new goes in. A turn not heard
//! of for a lease's time is checked against the database, which says when it ended even if its
//! end never crosses the bus.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::{BusError, Inner, RETRY, conversation_filter, message_head, open_subject};
use crate::hub::{Following, Hub, TurnBuffer};
use crate::metrics::Metrics;
use crate::wire::{AgentEvent, TurnSealedEvent};

/// A wait of half to one and a half `RETRY`: the followers a reconnection stops all at once
/// (thousands on a busy gateway) do not all ask NATS for a consumer in the same instant.
fn retry_delay() -> Duration {
    let thousandths = (uuid::Uuid::new_v4().as_u128() % 1000) as u32;
    RETRY / 2 + RETRY * thousandths / 1000
}

pub(super) fn start(inner: Arc<Inner>, hub: Weak<Hub>, conversation_id: Arc<str>) -> Following {
    let (caught_up, waiting) = watch::channel(false);
    let metrics = inner.metrics.clone();
    let feed = Feed {
        hub,
        conversation_id,
        node: inner.node.clone(),
        turn: None,
        live: false,
        ended: None,
        metrics,
        parts: None,
    };
    let task = tokio::spawn(follow(inner, feed, caught_up));
    Following::new(waiting, task.abort_handle())
}

async fn follow(inner: Arc<Inner>, mut feed: Feed, caught_up: watch::Sender<bool>) {
    // The last stream sequence read: a consumer that ends is replaced from the next one on.
    let mut read = None;
    loop {
        match consume(&inner, &mut feed, &caught_up, &mut read).await {
            Ok(()) => tracing::debug!(conversation = %feed.conversation_id, "a bus consumer ended; starting another"),
            // With the bus down every follower fails each time (the loss is said once, in mod.rs).
            Err(e) if !super::connected(&inner.client) => {
                tracing::debug!(conversation = %feed.conversation_id, error = %e, "following a conversation on the bus failed; retrying");
            }
            Err(e) => {
                tracing::warn!(conversation = %feed.conversation_id, error = %e, "following a conversation on the bus failed; retrying");
                // The stream may be what is gone: with it back, this conversation's turns are heard again.
                if let Err(e) = inner.shared.restore(&inner.js).await {
                    tracing::debug!(error = %e, "cannot create the bus's stream again");
                }
            }
        }
        // Nobody waits on a bus that fails; what comes later goes straight in.
        feed.go_live();
        caught_up.send_replace(true);
        // A turn followed that the bus cannot end: the database says when it has.
        if feed.quiet_deadline(quiet_period(&inner)).is_some_and(|at| at <= Instant::now()) {
            feed.check_running(&inner, read).await;
        }
        tokio::time::sleep(retry_delay()).await;
    }
}

/// How long a turn followed may go unheard of before the database is asked whether it runs:
/// a lease's time (its gateway renews it meanwhile), at least a `RETRY` (leases as short as
/// tests use would have every quiet turn asked for many times a second).
fn quiet_period(inner: &Inner) -> Duration {
    inner.store.lease_ttl().max(RETRY)
}

/// Where a follower has read to: the stream (by its creation time) and the sequence in it.
type Read = Option<(i128, u64)>;

/// Follows with one consumer until it ends, fails, or the connection or the stream comes back
/// (an epoch: the client's own consumer would come back on its own, but from its old sequence,
/// which in a stream created again skips what is new).
async fn consume(
    inner: &Inner,
    feed: &mut Feed,
    caught_up: &watch::Sender<bool>,
    read: &mut Read,
) -> Result<(), BusError> {
    let mut epoch = inner.shared.epoch();
    let info = inner.shared.stream.get_info().await.map_err(BusError::js)?;
    let (created, last) = (info.created.unix_timestamp_nanos(), info.state.last_sequence);
    // A stream created again since the last read starts its sequence over: it is followed from
    // the conversation's latest turn in it.
    let read_here = read.filter(|(stream, _)| *stream == created).map(|(_, seq)| seq);
    let start = match read_here {
        Some(seq) => seq + 1,
        None => match inner.shared.last_message(&open_subject(&feed.conversation_id)).await? {
            Some(open) => open.sequence,
            None => last + 1,
        },
    };
    if start > last {
        feed.go_live();
        caught_up.send_replace(true);
    }
    let config = pull::OrderedConfig {
        filter_subject: conversation_filter(&feed.conversation_id),
        deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: start },
        ..Default::default()
    };
    let consumer = inner.shared.stream.create_consumer(config).await.map_err(BusError::js)?;
    let mut messages = consumer.messages().await.map_err(BusError::js)?;
    // Quiet turns are looked for on a tick, not with a timer per message: a turn is asked about
    // between one and two periods after it went quiet.
    let mut quiet = tokio::time::interval(quiet_period(inner));
    quiet.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let gap = feed.gap_deadline(inner.timeout);
        let message = tokio::select! {
            message = messages.next() => match message {
                Some(message) => message.map_err(BusError::js)?,
                None => return Ok(()),
            },
            _ = epoch.changed() => return Ok(()),
            _ = tokio::time::sleep_until(gap.unwrap_or_else(Instant::now).into()), if gap.is_some() => {
                feed.overdue();
                continue;
            }
            _ = quiet.tick() => {
                if feed.quiet_deadline(quiet_period(inner)).is_some_and(|at| at <= Instant::now()) {
                    feed.check_running(inner, *read).await;
                }
                continue;
            }
        };
        let info = message.info().map_err(BusError::js)?;
        *read = Some((created, info.stream_sequence));
        let pending = info.pending;
        let head = message_head(inner, &message.subject, message.headers.as_ref(), &message.payload);
        let taken = match super::message_part(message.headers.as_ref()) {
            None => {
                feed.parts = None;
                feed.take(head, &message.payload)
            }
            // Part of an event too large for one message: taken once whole.
            Some(part) => match feed.gather(head.clone(), part, &message.payload) {
                Some(whole) => feed.take(head, &whole),
                None => feed.hub.strong_count() > 0,
            },
        };
        if !taken {
            return Ok(()); // the hub is gone
        }
        if pending == 0 && !*caught_up.borrow() {
            feed.go_live();
            caught_up.send_replace(true);
        }
    }
}

/// Quiet periods a turn the database says ended is waited for while the stream holds more of
/// its conversation than was read.
const MOST_WAITS: u8 = 3;

/// Whether the stream holds a message of the conversation past `read` (the last one this
/// follower read): false when it holds none, or cannot be asked (the bus is down: what it holds
/// cannot be read either).
async fn unread(inner: &Inner, conversation_id: &str, read: Read) -> bool {
    let Ok(info) = inner.shared.stream.get_info().await else { return false };
    let read_here = read.filter(|(stream, _)| *stream == info.created.unix_timestamp_nanos()).map_or(0, |(_, seq)| seq);
    for subject in [open_subject(conversation_id), super::more_subject(conversation_id)] {
        if let Ok(Some(last)) = inner.shared.last_message(&subject).await
            && last.sequence > read_here
        {
            return true;
        }
    }
    false
}

/// What the stream has said of the conversation's turns, and how it reaches the hub.
struct Feed {
    hub: Weak<Hub>,
    conversation_id: Arc<str>,
    node: String,
    /// The turn being followed: another gateway's, opened since following began.
    turn: Option<RemoteTurn>,
    /// Caught up: events go into the hub as they come.
    live: bool,
    /// The last turn that ended here, whose messages sent again are not news.
    ended: Option<String>,
    metrics: Arc<Metrics>,
    /// The parts of a large event read so far (`publish.rs` splits one larger than a message).
    parts: Option<Parts>,
}

/// An event's line being joined from its parts, in order.
struct Parts {
    /// Whose event: gateway, turn, index.
    head: (String, String, u32),
    /// The next part expected, and how many there are.
    next: u32,
    of: u32,
    line: Vec<u8>,
}

/// The most bytes a large event's parts may add up to while joined (the hub's own caps apply
/// once it is whole).
const MOST_JOINED: usize = 256 * 1024 * 1024;

struct RemoteTurn {
    turn_id: String,
    /// Index of the next event expected.
    next: u32,
    /// Its buffer in the hub, once live.
    buffer: Option<Arc<TurnBuffer>>,
    /// Its events while catching up.
    early: Vec<AgentEvent>,
    /// Since when events are missing (a later message came first).
    gap: Option<Instant>,
    /// When it was last heard of: its last message, or the database saying it runs.
    heard: Instant,
    /// Times its end was waited for on the stream after the database said it ended (bounded:
    /// a consumer that cannot read what the stream holds must not keep the watchers for ever).
    waited: u8,
}

impl RemoteTurn {
    fn new(turn_id: String) -> RemoteTurn {
        RemoteTurn { turn_id, next: 0, buffer: None, early: Vec::new(), gap: None, heard: Instant::now(), waited: 0 }
    }
}

impl Feed {
    /// Takes one message; false when the hub is gone.
    fn take(&mut self, head: Option<(String, String, u32)>, payload: &[u8]) -> bool {
        let Some(hub) = self.hub.upgrade() else { return false };
        // Unsigned, or without the headers that say whose it is: refused and said (`message_head`).
        let Some((node, turn_id, index)) = head else { return true };
        if node == self.node {
            return true; // this gateway's own turn: its hub has it already
        }
        let mut events = Vec::new();
        for line in payload.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice::<AgentEvent>(line) {
                // Events of another conversation or turn than the message says are not relayed.
                Ok(event) if event.ids() != (&*self.conversation_id, Some(turn_id.as_str())) => {
                    super::sign::reject(
                        &self.metrics,
                        "events of another turn than their message's",
                        &self.conversation_id,
                    );
                    return true;
                }
                Ok(event) => events.push(event),
                Err(e) => {
                    tracing::warn!(conversation = %self.conversation_id, error = %e, "skipped a bus message that is not events");
                    return true;
                }
            }
        }
        if self.ended.as_deref() == Some(turn_id.as_str()) {
            return true; // a turn that ended here, sent again: nothing new
        }
        // A turn's start opens it, unless it is the turn followed, sent again from its start.
        if index == 0 && self.turn.as_ref().is_none_or(|t| t.turn_id != turn_id) {
            if let Some(unfinished) = self.turn.take() {
                self.abandon(&hub, unfinished);
            }
            self.turn = Some(RemoteTurn::new(turn_id.clone()));
        }
        // A turn opened before following began, or messages of one that ended: not replayed.
        let Some(turn) = self.turn.as_mut().filter(|t| t.turn_id == turn_id) else { return true };
        if index > turn.next {
            // Events missing: its gateway sends the turn again from what the stream did not
            // acknowledge when the bus may have lost some (`publish.rs`). Until then (at most the bus timeout, `overdue`) its
            // watchers here wait; its end ends it.
            if matches!(events.last(), Some(AgentEvent::TurnSealed(_))) {
                tracing::warn!(conversation = %self.conversation_id, turn = %turn_id, "a turn ended with events missing on the bus; its watchers here read them from history");
                let unfinished = self.turn.take().expect("just matched");
                self.abandon(&hub, unfinished);
            } else {
                turn.gap.get_or_insert_with(Instant::now);
            }
            return true;
        }
        turn.heard = Instant::now();
        // A message read again (a replaced consumer) adds only what is new.
        let fresh: Vec<AgentEvent> = events.into_iter().skip((turn.next - index) as usize).collect();
        // Only new events fill a gap: a sending again that repeats what is here and again lacks
        // the missing event (one the bus refuses) would otherwise restart the wait each time.
        if !fresh.is_empty() {
            turn.gap = None;
        }
        turn.next += fresh.len() as u32;
        let sealed = matches!(fresh.last(), Some(AgentEvent::TurnSealed(_)));
        if !self.live {
            turn.early.extend(fresh);
            if sealed {
                self.turn = None; // ended before this gateway caught up: history, not replay
                self.ended = Some(turn_id);
            }
            return true;
        }
        let (body, end) = if sealed { fresh.split_at(fresh.len() - 1) } else { (&fresh[..], &[][..]) };
        match &turn.buffer {
            Some(buffer) => buffer.publish_all(body),
            None => turn.buffer = Some(hub.begin_remote_turn(&self.conversation_id, &turn_id, body)),
        }
        if let Some(sealed) = end.first() {
            let buffer = self.turn.take().and_then(|t| t.buffer).expect("opened above");
            hub.seal_turn(buffer, sealed);
            self.ended = Some(turn_id);
        }
        true
    }

    /// Adds part `k` of `n` of an event's line; the whole line once its last part came, all in
    /// order. A part out of order (a sending again starts over from part 1), of another event,
    /// or past `MOST_JOINED` drops what was gathered.
    fn gather(&mut self, head: Option<(String, String, u32)>, (k, n): (u32, u32), payload: &[u8]) -> Option<Vec<u8>> {
        let head = head?;
        if k == 1 {
            self.parts = Some(Parts { head: head.clone(), next: 1, of: n, line: Vec::new() });
        }
        let parts = self.parts.as_mut().filter(|p| p.head == head && p.next == k && p.of == n);
        let Some(parts) = parts.filter(|p| p.line.len() + payload.len() <= MOST_JOINED) else {
            self.parts = None;
            return None;
        };
        parts.line.extend_from_slice(payload);
        parts.next += 1;
        if k < n {
            return None;
        }
        self.parts.take().map(|p| p.line)
    }

    /// When the turn followed, waiting on missing events, is given up.
    fn gap_deadline(&self, wait: Duration) -> Option<Instant> {
        self.turn.as_ref().and_then(|t| t.gap).map(|since| since + wait)
    }

    /// Gives up on missing events that did not come in time: the turn's watchers here get
    /// `turn-sealed` and read the rest from history.
    fn overdue(&mut self) {
        let Some(hub) = self.hub.upgrade() else { return };
        if let Some(turn) = self.turn.take_if(|t| t.gap.is_some()) {
            tracing::warn!(conversation = %self.conversation_id, turn = %turn.turn_id, expected = turn.next, "events of a turn are missing on the bus; ending it here");
            self.abandon(&hub, turn);
        }
    }

    /// When the turn followed, live here and quiet (nothing heard of it for `period`), is to be
    /// checked against the database: its end may never come over the bus (its gateway died
    /// after the seal, or the bus was down when it ended and is still).
    fn quiet_deadline(&self, period: Duration) -> Option<Instant> {
        let turn = self.turn.as_ref().filter(|t| t.buffer.is_some() && t.gap.is_none())?;
        Some(turn.heard + period)
    }

    /// Asks the database whether the turn followed still holds its conversation's lease; one
    /// that does not has ended (sealed, or marked interrupted): unless the stream holds messages
    /// of the conversation this follower has not read yet (its end, most likely: a gateway that
    /// was paused, by a VM pause or `docker pause`, finds its timers due before it has read what
    /// waited meanwhile), its watchers here get `turn-sealed` and read it from history. Asked
    /// again a period later otherwise.
    async fn check_running(&mut self, inner: &Inner, read: Read) {
        let Some(turn_id) = self.turn.as_ref().map(|t| t.turn_id.clone()) else { return };
        match inner.store.lease_holder(&self.conversation_id).await {
            Ok(holder) if holder.as_deref() != Some(turn_id.as_str()) => {
                let waited = self.turn.as_ref().map_or(0, |t| t.waited);
                if waited < MOST_WAITS && unread(inner, &self.conversation_id, read).await {
                    tracing::debug!(conversation = %self.conversation_id, turn = %turn_id, "a turn followed here ended; its end waits on the stream");
                    if let Some(turn) = self.turn.as_mut() {
                        turn.heard = Instant::now();
                        turn.waited += 1;
                    }
                    return;
                }
                let Some(hub) = self.hub.upgrade() else { return };
                let turn = self.turn.take().expect("matched above");
                tracing::warn!(conversation = %self.conversation_id, turn = %turn_id, "a turn followed here ended without its end on the bus; ending it here");
                self.abandon(&hub, turn);
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(conversation = %self.conversation_id, error = %e, "cannot ask the database whether a turn runs")
            }
        }
        if let Some(turn) = self.turn.as_mut() {
            turn.heard = Instant::now();
        }
    }

    /// Caught up: a turn still open goes into the hub with what it has published.
    fn go_live(&mut self) {
        self.live = true;
        let Some(hub) = self.hub.upgrade() else { return };
        if let Some(turn) = self.turn.as_mut()
            && turn.buffer.is_none()
        {
            let early = std::mem::take(&mut turn.early);
            turn.buffer = Some(hub.begin_remote_turn(&self.conversation_id, &turn.turn_id, &early));
        }
    }

    /// A turn whose end will not come (part of it is missing, or a later turn opened): its
    /// watchers here get `turn-sealed` and read the rest from history.
    fn abandon(&mut self, hub: &Arc<Hub>, turn: RemoteTurn) {
        self.ended = Some(turn.turn_id.clone());
        if let Some(buffer) = turn.buffer {
            self.metrics.bus.turns_cut.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let sealed = AgentEvent::TurnSealed(TurnSealedEvent {
                conversation_id: self.conversation_id.to_string(),
                turn_id: turn.turn_id,
            });
            hub.seal_turn(buffer, &sealed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{Delivery, FlushWindow};

    fn line(event: serde_json::Value) -> String {
        format!("{event}\n")
    }

    fn text(turn: &str, delta: &str) -> String {
        line(serde_json::json!({"type": "text-delta", "conversationId": "c", "turnId": turn, "delta": delta}))
    }

    fn sealed(turn: &str) -> String {
        line(serde_json::json!({"type": "turn-sealed", "conversationId": "c", "turnId": turn}))
    }

    fn head(node: &str, turn: &str, index: u32) -> Option<(String, String, u32)> {
        Some((node.to_owned(), turn.to_owned(), index))
    }

    fn feed(hub: &Arc<Hub>) -> Feed {
        Feed {
            hub: Arc::downgrade(hub),
            conversation_id: Arc::from("c"),
            node: "here".into(),
            turn: None,
            live: false,
            ended: None,
            metrics: Default::default(),
            parts: None,
        }
    }

    #[test]
    fn a_large_events_parts_are_joined_in_order_and_a_broken_sequence_is_dropped() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let mut feed = feed(&hub);
        let line = text("t1", &"x".repeat(100));
        let (a, b, c) = (&line.as_bytes()[..40], &line.as_bytes()[40..80], &line.as_bytes()[80..]);
        assert_eq!(feed.gather(head("there", "t1", 0), (1, 3), a), None);
        assert_eq!(feed.gather(head("there", "t1", 0), (2, 3), b), None);
        assert_eq!(feed.gather(head("there", "t1", 0), (3, 3), c).as_deref(), Some(line.as_bytes()));
        // Out of order, of another event, or with no start: nothing comes of it.
        assert_eq!(feed.gather(head("there", "t1", 0), (1, 3), a), None);
        assert_eq!(feed.gather(head("there", "t1", 0), (3, 3), c), None, "part 2 is missing");
        assert_eq!(feed.gather(head("there", "t1", 0), (1, 3), a), None);
        assert_eq!(feed.gather(head("there", "t1", 1), (2, 3), b), None, "another event's");
        assert_eq!(feed.gather(head("there", "t1", 0), (3, 3), c), None);
        // A sending again starts over from its first part.
        for (k, piece) in [(1, a), (2, b), (1, a), (2, b)] {
            assert_eq!(feed.gather(head("there", "t1", 0), (k, 3), piece), None);
        }
        assert_eq!(feed.gather(head("there", "t1", 0), (3, 3), c).as_deref(), Some(line.as_bytes()));
    }

    /// The deltas of the turn in flight, read from its start.
    async fn deltas(hub: &Arc<Hub>) -> Vec<String> {
        let buffer = hub.current("c").await.expect("a turn in flight");
        read_on(&mut hub.read_turn(&buffer)).await.0
    }

    #[test]
    fn followers_start_over_spread_around_a_second() {
        let delays: Vec<Duration> = (0..200).map(|_| retry_delay()).collect();
        assert!(delays.iter().all(|d| (RETRY / 2..RETRY * 3 / 2).contains(d)), "{delays:?}");
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "spread, not one instant: {} distinct", distinct.len());
    }

    #[tokio::test]
    async fn what_the_stream_says_reaches_the_hub_once_in_order_and_what_is_not_a_turns_event_is_skipped() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let mut feed = feed(&hub);
        // Catching up: a turn that ended is history; the one still open is gathered.
        assert!(feed.take(head("there", "t0", 0), (text("t0", "old") + &sealed("t0")).as_bytes()));
        assert!(feed.take(head("there", "t1", 0), text("t1", "a").as_bytes()));
        assert!(feed.take(head("there", "t1", 1), text("t1", "b").as_bytes()));
        assert!(hub.current("c").await.is_none(), "nothing reaches the hub before the catch-up ends");
        feed.go_live();
        assert_eq!(deltas(&hub).await, ["a", "b"]);
        // Hostile or stray messages change nothing: no headers, not events, this gateway's own,
        // another turn's, one read again.
        assert!(feed.take(None, text("t1", "x").as_bytes()));
        assert!(feed.take(head("there", "t1", 2), b"not json\n"));
        assert!(feed.take(head("here", "t1", 2), text("t1", "mine").as_bytes()));
        assert!(feed.take(head("there", "t9", 5), text("t9", "stray").as_bytes()));
        // Events that say another turn than their message's headers: refused whole.
        assert!(feed.take(head("there", "t1", 2), text("t9", "forged").as_bytes()));
        assert!(feed.take(head("there", "t1", 1), (text("t1", "b") + &text("t1", "c")).as_bytes()));
        assert_eq!(deltas(&hub).await, ["a", "b", "c"], "only c was new");
        // The end seals the hub's buffer.
        assert!(feed.take(head("there", "t1", 3), sealed("t1").as_bytes()));
        assert!(hub.current("c").await.is_none());
    }

    /// The next batch a cursor reads: its deltas, and whether it ends with `turn-sealed`.
    async fn read_on(cursor: &mut crate::hub::Cursor) -> (Vec<String>, bool) {
        match cursor.next_batch(usize::MAX).await {
            Delivery::Events(events) => {
                let sealed = events.last().is_some_and(|e| e.is_sealed());
                let deltas = events
                    .iter()
                    .filter(|e| !e.is_sealed())
                    .map(|e| {
                        let event: serde_json::Value = serde_json::from_slice(&e.line).unwrap();
                        event["delta"].as_str().unwrap().to_owned()
                    })
                    .collect();
                (deltas, sealed)
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_gap_waits_for_the_turn_sent_again_from_its_start_and_goes_on_without_repeats() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let mut feed = feed(&hub);
        feed.go_live();
        assert!(feed.take(head("there", "t1", 0), text("t1", "a").as_bytes()));
        let mut cursor = hub.read_turn(&hub.current("c").await.expect("the turn is in the hub"));
        assert_eq!(read_on(&mut cursor).await, (vec!["a".to_owned()], false));
        // Event 1 is lost; 2 comes first: the watchers here wait, with nothing yet.
        assert!(feed.take(head("there", "t1", 2), text("t1", "c").as_bytes()));
        let waiting = feed.gap_deadline(Duration::from_secs(5));
        assert!(waiting.is_some(), "waiting on the gap");
        assert!(hub.current("c").await.is_some(), "the turn goes on here");
        // Sent again without the missing event: what is here already does not restart the wait.
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(feed.take(head("there", "t1", 0), text("t1", "a").as_bytes()));
        assert_eq!(feed.gap_deadline(Duration::from_secs(5)), waiting, "the wait runs on");
        // The turn sent again from its start: only what is new reaches the watchers, once.
        let again = text("t1", "a") + &text("t1", "b") + &text("t1", "c");
        assert!(feed.take(head("there", "t1", 0), again.as_bytes()));
        assert!(feed.gap_deadline(Duration::from_secs(5)).is_none(), "the gap is filled");
        assert!(feed.take(head("there", "t1", 3), (text("t1", "d") + &sealed("t1")).as_bytes()));
        let (mut deltas, mut sealed_here) = (Vec::new(), false);
        while !sealed_here {
            let (more, sealed) = read_on(&mut cursor).await;
            deltas.extend(more);
            sealed_here = sealed;
        }
        assert_eq!(deltas, ["b", "c", "d"]);
        // The ended turn sent again (a late sending) is not news.
        assert!(feed.take(head("there", "t1", 0), (again + &text("t1", "d") + &sealed("t1")).as_bytes()));
        assert!(hub.current("c").await.is_none(), "the ended turn is not opened again");
        assert_eq!(feed.metrics.bus.turns_cut.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_gap_not_filled_ends_the_turn_for_the_watchers_here_at_its_end_or_in_time() {
        let hub = Hub::new(1 << 20, FlushWindow::default());
        let mut feed = feed(&hub);
        feed.go_live();
        for (turn, finish) in [("t1", "its end"), ("t2", "the timeout")] {
            assert!(feed.take(head("there", turn, 0), text(turn, "a").as_bytes()));
            let mut cursor = hub.read_turn(&hub.current("c").await.expect("the turn is in the hub"));
            assert_eq!(read_on(&mut cursor).await, (vec!["a".to_owned()], false));
            assert!(feed.take(head("there", turn, 2), text(turn, "c").as_bytes()));
            if finish == "its end" {
                assert!(feed.take(head("there", turn, 3), sealed(turn).as_bytes()));
            } else {
                feed.overdue();
            }
            // The watchers get turn-sealed and read the rest from history.
            assert_eq!(read_on(&mut cursor).await, (vec![], true), "{finish}");
            assert!(hub.current("c").await.is_none(), "{finish}");
        }
        assert_eq!(feed.metrics.bus.turns_cut.load(std::sync::atomic::Ordering::Relaxed), 2, "/metrics counts them");
        // A gone hub stops the feed.
        drop(hub);
        assert!(!feed.take(head("there", "t3", 0), text("t3", "a").as_bytes()));
    }
}
