//! The events of this gateway's turns, out to the stream.

use std::collections::BTreeMap;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Instant;

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc;

use super::{Head, Inner, RETRY, message_headers, more_subject, open_subject};
use crate::hub::{Outbox, Outgoing};

/// A message stays well under NATS's payload limit (1 MiB unless the server says otherwise).
const HEADROOM: usize = 4096;

pub(super) fn outbox(inner: &Arc<Inner>, conversation_id: &str, turn_id: &str, cap: usize) -> Outbox {
    let (outbox, events, pending) = Outbox::new(cap);
    let turn = Turn {
        inner: inner.clone(),
        open: open_subject(conversation_id),
        more: more_subject(conversation_id),
        turn_id: turn_id.to_owned(),
    };
    tokio::spawn(turn.publish(events, pending, cap));
    outbox
}

struct Turn {
    inner: Arc<Inner>,
    open: String,
    more: String,
    turn_id: String,
}

/// A message's acknowledgement, with what it carried (the client's future is boxed already: a
/// combinator around it would box it again, an allocation per message).
struct Ack {
    sent: Sent,
    ack: <PublishAckFuture as IntoFuture>::IntoFuture,
}

impl Future for Ack {
    type Output = (Sent, Result<PublishAck, PublishError>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let sent = self.sent;
        self.ack.as_mut().poll(cx).map(|ack| (sent, ack))
    }
}

/// What a message carried: events `first..end`, sent into a stream (its creation time) as part
/// of a sending of the turn (`generation`).
#[derive(Clone, Copy)]
struct Sent {
    generation: u64,
    stream: i64,
    first: u32,
    end: u32,
}

impl Turn {
    /// Publishes what the turn's outbox gets, in order, each burst as few messages as fit,
    /// without waiting for one's acknowledgement before sending the next; ends with the turn.
    ///
    /// When the bus may have lost part of the turn (an acknowledgement failed, the connection
    /// came back, the stream was created again), the turn is sent again (a new generation)
    /// from its first event the stream is not known to hold: its start in a stream created
    /// again. What comes next follows it. The followers elsewhere, which wait on a gap, read it
    /// as a re-read and go on (`follow.rs`). After the turn's end this goes on for the bus
    /// timeout; then only the end is kept, and waits for the bus as long as the stream keeps
    /// events: without it the turn's watchers elsewhere would wait for the next turn.
    async fn publish(self, mut events: mpsc::UnboundedReceiver<Vec<Outgoing>>, pending: Arc<AtomicUsize>, cap: usize) {
        let limit = (self.inner.client.server_info().max_payload.max(2 * HEADROOM) - HEADROOM).max(HEADROOM);
        let mut acks = FuturesUnordered::new();
        let mut generation = 0;
        let mut kept = Kept::new(cap);
        let mut stored = Stored::new(self.inner.shared.created());
        let mut epoch = self.inner.shared.epoch();
        // When the turn is sent again.
        let mut resend: Option<Instant> = None;
        let mut ended: Option<Instant> = None;
        let mut misses = 0;
        let mut burst: Vec<Outgoing> = Vec::new();
        loop {
            if let Some(at) = ended {
                if acks.is_empty() && resend.is_none() {
                    break;
                }
                if at.elapsed() >= self.inner.max_age {
                    tracing::warn!(turn = %self.turn_id, "the bus did not take the end of a turn: its watchers elsewhere read it from history");
                    break;
                }
                if at.elapsed() >= self.inner.timeout && kept.trim_to_end() {
                    tracing::warn!(turn = %self.turn_id, "the bus did not take the end of a turn in time: it goes out alone when the bus is back");
                }
            }
            let due = resend.unwrap_or_else(Instant::now);
            tokio::select! {
                got = events.recv(), if ended.is_none() => {
                    let Some(first) = got else {
                        ended = Some(Instant::now());
                        continue;
                    };
                    burst.extend(first);
                    while let Ok(more) = events.try_recv() {
                        burst.extend(more);
                    }
                    pending.fetch_sub(burst.iter().map(|e| e.line.len()).sum(), Relaxed);
                    if burst.iter().any(|e| e.last) {
                        ended = Some(Instant::now());
                    }
                    kept.add(&burst);
                    if !self.send(&burst, false, limit, generation, &mut acks, &mut misses).await {
                        again_later(&mut resend, &kept);
                    }
                    burst.clear();
                }
                Some((sent, ack)) = acks.next(), if !acks.is_empty() => match ack {
                    Ok(_) => stored.acknowledged(sent),
                    Err(e) => {
                        use PublishErrorKind::*;
                        let again = matches!(e.kind(), StreamNotFound | TimedOut | BrokenPipe | MaxAckPending);
                        self.missed(&mut misses, e);
                        // A failure of an earlier sending is covered by the one after it.
                        if again && sent.generation == generation {
                            again_later(&mut resend, &kept);
                        }
                    }
                },
                Ok(()) = epoch.changed() => {
                    // The connection or the stream came back: what it holds of the turn is unknown.
                    if !kept.events.is_empty() {
                        resend = Some(Instant::now());
                    }
                }
                _ = tokio::time::sleep_until(due.into()), if resend.is_some() => {
                    if !super::connected(&self.inner.client) {
                        resend = Some(Instant::now() + RETRY);
                        continue;
                    }
                    resend = None;
                    let Some(kept_from) = kept.events.first().map(|e| e.index) else {
                        continue; // grown past what is kept since: its followers end it
                    };
                    // The stream itself may be what is gone (`restore` asks at most once a second).
                    if let Err(e) = self.inner.shared.restore(&self.inner.js).await {
                        tracing::warn!(error = %e, "cannot create the bus's stream again");
                    }
                    let held = stored.resend_from(self.inner.shared.created());
                    let from = held.max(kept_from);
                    let Some(events) = kept.events.get((from - kept_from) as usize..).filter(|e| !e.is_empty()) else {
                        continue; // the stream holds all of it
                    };
                    generation += 1;
                    tracing::info!(turn = %self.turn_id, from, "sending a turn again: the bus may have lost part of it");
                    self.inner.metrics.bus.turns_resent.fetch_add(1, Relaxed);
                    // Into a stream that holds nothing of the turn, the first message opens it
                    // there (its start, or its end alone when only that is kept), where a
                    // follower starting over looks (`follow.rs`).
                    if !self.send(events, held == 0, limit, generation, &mut acks, &mut misses).await {
                        again_later(&mut resend, &kept);
                    }
                }
            }
        }
        if misses > 1 {
            tracing::warn!(turn = %self.turn_id, messages = misses, "the bus did not take messages of a turn");
        }
    }

    /// Sends `events` as runs, their acknowledgements into `acks`; the first on the `open`
    /// subject when it is the turn's start or `opens`. False when the client refused one.
    async fn send(
        &self,
        events: &[Outgoing],
        opens: bool,
        limit: usize,
        generation: u64,
        acks: &mut FuturesUnordered<Ack>,
        misses: &mut usize,
    ) -> bool {
        let stream = self.inner.shared.created();
        let opening = events.first().map(|e| e.index).filter(|_| opens);
        let mut taken = true;
        for Run { first, end, payload, part } in runs(events, limit) {
            let subject = if first == 0 || Some(first) == opening { &self.open } else { &self.more };
            let head = Head { subject, node: &self.inner.node, turn_id: &self.turn_id, index: first, part };
            let head = message_headers(&self.inner.signer, head, &payload);
            let message = PublishMessage::build().headers(head).payload(payload);
            // A part short of an event's last holds no whole event: the stream holds the event
            // once its last part is acknowledged.
            let end = if part.is_some_and(|(k, n)| k < n) { first } else { end };
            let sent = Sent { generation, stream, first, end };
            match self.inner.js.send_publish(subject.clone(), message).await {
                Ok(ack) => acks.push(Ack { sent, ack: ack.into_future() }),
                Err(e) => {
                    self.missed(misses, e);
                    taken = false;
                }
            }
        }
        taken
    }

    /// A message the bus did not take: the first of a turn is logged (a bus that is down fails
    /// them all), the others counted.
    fn missed(&self, misses: &mut usize, error: impl std::fmt::Display) {
        self.inner.metrics.bus.messages_missed.fetch_add(1, Relaxed);
        if *misses == 0 {
            tracing::warn!(turn = %self.turn_id, error = %error, "the bus did not take a turn's events");
        }
        *misses += 1;
    }
}

/// The turn's events so far, to send it again: all of them or none but its end (past the
/// outbox's cap or a gap the outbox left, the stream cannot be given the whole turn; the
/// followers end it for their watchers when its end comes).
struct Kept {
    /// Consecutive events, from the turn's start unless cut to its end.
    events: Vec<Outgoing>,
    bytes: usize,
    cap: usize,
    whole: bool,
}

impl Kept {
    fn new(cap: usize) -> Kept {
        Kept { events: Vec::new(), bytes: 0, cap, whole: true }
    }

    fn add(&mut self, burst: &[Outgoing]) {
        for event in burst {
            let len = event.line.len();
            let next = self.events.len() as u32;
            if self.whole && (event.index != next || self.bytes + len > self.cap) {
                self.whole = false;
                self.events = Vec::new();
                tracing::debug!(
                    index = event.index,
                    "a turn is past what its publisher keeps: only its end is sent again"
                );
            }
            if self.whole || event.last {
                self.bytes += len;
                self.events.push(Outgoing { index: event.index, line: event.line.clone(), last: event.last });
            }
        }
    }

    /// Keeps only the turn's end (it has ended): what a follower elsewhere needs to end it,
    /// without the rest of its lines. True when that dropped something.
    fn trim_to_end(&mut self) -> bool {
        if self.events.len() <= 1 {
            return false;
        }
        self.events.drain(..self.events.len() - 1);
        self.whole = false;
        true
    }
}

/// A sending that failed is tried again a `RETRY` later, when anything is kept to send.
fn again_later(resend: &mut Option<Instant>, kept: &Kept) {
    if !kept.events.is_empty() && resend.is_none() {
        *resend = Some(Instant::now() + RETRY);
    }
}

/// How much of the turn the stream is known to hold: the events whose messages it
/// acknowledged, from the turn's start on.
struct Stored {
    /// The stream (its creation time) that holds them.
    stream: i64,
    /// Events `0..through` are held.
    through: u32,
    /// Runs held past the first one not acknowledged (yet, or ever): first index to end.
    later: BTreeMap<u32, u32>,
}

impl Stored {
    fn new(stream: i64) -> Stored {
        Stored { stream, through: 0, later: BTreeMap::new() }
    }

    fn acknowledged(&mut self, sent: Sent) {
        if sent.stream != self.stream {
            return; // held by a stream that is gone
        }
        self.later.insert(sent.first, sent.end);
        while let Some(entry) = self.later.first_entry()
            && *entry.key() <= self.through
        {
            self.through = self.through.max(entry.remove());
        }
    }

    /// Where the turn is to be sent again from, into `stream` as it is now: from its start
    /// into a stream created again.
    fn resend_from(&mut self, stream: i64) -> u32 {
        if stream != self.stream {
            *self = Stored::new(stream);
        }
        self.through
    }
}

/// A message of a burst: events `first..end`, or part `k` of `n` of event `first`'s line.
#[derive(Debug, PartialEq)]
struct Run {
    first: u32,
    end: u32,
    payload: Bytes,
    part: Option<(u32, u32)>,
}

/// A burst as messages: runs of consecutive indices (an overflow leaves a gap), each under
/// `limit` bytes; an event larger than that alone goes as parts of it, each under `limit`, which
/// a follower joins again (`follow.rs`): a large tool result crosses the bus whole.
fn runs(burst: &[Outgoing], limit: usize) -> Vec<Run> {
    let mut out = Vec::new();
    let mut current: Option<(u32, u32, BytesMut)> = None;
    let flush = |current: &mut Option<(u32, u32, BytesMut)>, out: &mut Vec<Run>| {
        if let Some((first, end, payload)) = current.take() {
            out.push(Run { first, end, payload: payload.freeze(), part: None });
        }
    };
    for event in burst {
        if event.line.len() > limit {
            flush(&mut current, &mut out);
            let n = event.line.len().div_ceil(limit) as u32;
            for (k, at) in (0..event.line.len()).step_by(limit).enumerate() {
                let piece = event.line.slice(at..(at + limit).min(event.line.len()));
                out.push(Run {
                    first: event.index,
                    end: event.index + 1,
                    payload: piece,
                    part: Some((k as u32 + 1, n)),
                });
            }
            continue;
        }
        let fits = current
            .as_ref()
            .is_some_and(|(_, next, payload)| *next == event.index && payload.len() + event.line.len() <= limit);
        if !fits {
            flush(&mut current, &mut out);
        }
        let (_, next, payload) = current.get_or_insert_with(|| (event.index, event.index, BytesMut::new()));
        payload.extend_from_slice(&event.line);
        *next = event.index + 1;
    }
    flush(&mut current, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(index: u32, line: &str) -> Outgoing {
        Outgoing { index, line: Bytes::from(format!("{line}\n")), last: false }
    }

    #[test]
    fn a_burst_goes_out_as_runs_of_consecutive_events_under_the_limit() {
        let burst = [ev(0, "a"), ev(1, "b"), ev(2, "c"), ev(3, "dddddddd"), ev(7, "e"), ev(8, "f")];
        let run = |first, end, payload: &'static str, part| Run { first, end, payload: Bytes::from(payload), part };
        // Runs cut by the limit and by the gap an overflow left; an event over the limit in
        // parts, each under it.
        let expected = [
            run(0, 3, "a\nb\nc\n", None),
            run(3, 4, "dddddd", Some((1, 2))),
            run(3, 4, "dd\n", Some((2, 2))),
            run(7, 9, "e\nf\n", None),
        ];
        assert_eq!(runs(&burst, 6), expected);
    }

    /// A part header is `k/n` with `k` in `1..=n`; anything else is no part (and a message that
    /// is then not events is skipped where events are read).
    #[test]
    fn a_part_header_is_read_strictly() {
        let part = |value: &str| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(super::super::PART, value);
            super::super::message_part(Some(&headers))
        };
        assert_eq!(part("1/3"), Some((1, 3)));
        assert_eq!(part("3/3"), Some((3, 3)));
        for bad in ["0/3", "4/3", "0/0", "a/b", "1", "1/", "/3", "-1/3", "1/3/5", "99999999999/1"] {
            assert_eq!(part(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_turn_is_kept_to_be_sent_again_only_whole() {
        let kept = |cap: usize, burst: &[Outgoing]| {
            let mut kept = Kept::new(cap);
            kept.add(&burst[..1]);
            kept.add(&burst[1..]);
            (kept.whole, kept.events.iter().map(|e| e.index).collect::<Vec<_>>())
        };
        assert_eq!(kept(100, &[ev(0, "a"), ev(1, "b"), ev(2, "c")]), (true, vec![0, 1, 2]));
        // Past the cap, or after a gap the outbox left: nothing (a part sent again as the whole
        // would hide the gap). An event larger than a message is kept: it goes in parts.
        assert_eq!(kept(5, &[ev(0, "a"), ev(1, "b"), ev(2, "c")]), (false, vec![]));
        assert_eq!(kept(100, &[ev(0, "a"), ev(2, "c")]), (false, vec![]));
        assert_eq!(kept(100, &[ev(0, "a"), ev(1, "bbbbbbb")]), (true, vec![0, 1]));
        // Its end is kept whatever came before: without it, nothing tells a follower the turn ended.
        let end = || Outgoing { last: true, ..ev(3, "end") };
        assert_eq!(kept(5, &[ev(0, "a"), ev(1, "b"), ev(2, "c"), end()]), (false, vec![3]));
        assert_eq!(kept(100, &[ev(0, "a"), ev(1, "b"), ev(2, "c"), end()]), (true, vec![0, 1, 2, 3]));
    }

    #[test]
    fn a_turn_whose_end_waits_for_the_bus_keeps_only_its_end() {
        let mut kept = Kept::new(100);
        kept.add(&[ev(0, "a"), ev(1, "b"), Outgoing { last: true, ..ev(2, "end") }]);
        assert!(kept.trim_to_end());
        assert_eq!(kept.events.iter().map(|e| e.index).collect::<Vec<_>>(), [2]);
        assert!(!kept.trim_to_end(), "once");
    }

    #[test]
    fn the_stream_holds_a_turn_through_its_first_event_not_acknowledged() {
        let sent = |stream, first, end| Sent { generation: 0, stream, first, end };
        let mut stored = Stored::new(1);
        stored.acknowledged(sent(1, 0, 3));
        // 3..5 not acknowledged (lost, or its acknowledgement late); later runs are.
        stored.acknowledged(sent(1, 5, 8));
        stored.acknowledged(sent(1, 8, 9));
        assert_eq!(stored.resend_from(1), 3);
        stored.acknowledged(sent(1, 3, 5));
        assert_eq!(stored.resend_from(1), 9, "all of it held");
        // A run held by a stream since gone counts for nothing; a stream created again holds
        // none of the turn.
        stored.acknowledged(sent(2, 9, 12));
        assert_eq!(stored.resend_from(1), 9);
        assert_eq!(stored.resend_from(2), 0);
        stored.acknowledged(sent(1, 0, 12));
        assert_eq!(stored.resend_from(2), 0);
        stored.acknowledged(sent(2, 0, 4));
        assert_eq!(stored.resend_from(2), 4);
    }
}
