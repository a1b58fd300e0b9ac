//! A watcher's position in a conversation's stream of turns, and the SSE id that names one.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use super::Hub;
use super::buffer::{NextTurn, TurnBuffer, batch_end, start_of};
use crate::encoding::EncodedEvent;

/// What a cursor hands out next.
#[derive(Debug)]
pub enum Delivery {
    /// Events in order, all from one turn.
    Events(Vec<Arc<EncodedEvent>>),
    /// The cursor's position was coalesced away, or dropped with the oldest events of a buffer
    /// at its cap; it now reads its turn (this one) from the first event the buffer holds.
    Lost { turn_id: Arc<str> },
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
    Waiting(Arc<NextTurn>),
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
    /// Reads `buffer` from event `next` on; then later turns too with `follow`.
    pub(super) fn reading(hub: &Arc<Hub>, buffer: &Arc<TurnBuffer>, next: u32, follow: bool) -> Cursor {
        let at = Position::Reading { buffer: Reader::new(buffer.clone()), next };
        Cursor { at, follow, release: Some((hub.clone(), buffer.conversation_id.clone())) }
    }

    /// A cursor that never reads anything: the stream of a conversation the watcher may not see
    /// (it looks like one of an id nobody uses).
    pub fn idle() -> Cursor {
        Cursor { at: Position::Waiting(Arc::new(NextTurn::default())), follow: true, release: None }
    }

    /// Waits for the turn that will fill `next`, then follows every later one.
    pub(super) fn waiting(hub: &Arc<Hub>, conversation_id: Arc<str>, next: Arc<NextTurn>) -> Cursor {
        Cursor { at: Position::Waiting(next), follow: true, release: Some((hub.clone(), conversation_id)) }
    }

    /// The turn this cursor reads and the index of the next event it hands out (`None` while it
    /// waits for a turn to begin, or has ended).
    pub fn position(&self) -> Option<(&Arc<TurnBuffer>, u32)> {
        match &self.at {
            Position::Reading { buffer, next } => Some((&buffer.buffer, *next)),
            _ => None,
        }
    }

    /// The turn this cursor reads, or (while it waits) the one that has begun since: the turn
    /// a stream is replaying, whose events its client must not also read from history.
    pub fn replaying(&self) -> Option<Arc<str>> {
        match &self.at {
            Position::Reading { buffer, .. } => Some(buffer.buffer.turn_id.clone()),
            Position::Waiting(next) => next.turn.get().map(|b| b.turn_id.clone()),
            Position::Done => None,
        }
    }

    /// Moves the position within the turn being read to event `next` (where the rounds that
    /// wrote for this cursor's parked stream left off).
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

    /// Waits until something is available, then returns every available event up to `max`.
    /// Cancel-safe: the position only moves when events are returned.
    pub async fn next_batch(&mut self, max: usize) -> Delivery {
        loop {
            match &mut self.at {
                Position::Done => return Delivery::End,
                Position::Waiting(next) => {
                    let next = next.clone();
                    let filled = next.filled.notified();
                    tokio::pin!(filled);
                    filled.as_mut().enable();
                    if let Some(buffer) = next.turn.get() {
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
                        let st = buffer.state();
                        let start = start_of(&st.events, *next);
                        // Lost: its position was coalesced into an event that began before it, or
                        // went with the oldest events past the buffer's cap. It goes on from the
                        // first event still held.
                        if st.events.get(start).is_some_and(|f| f.first != *next) {
                            *next = st.events.first().map_or(0, |f| f.first);
                            return Delivery::Lost { turn_id: buffer.turn_id.clone() };
                        }
                        let end = batch_end(&st.events, st.largest, start, max);
                        let batch: Vec<Arc<EncodedEvent>> = st.events[start..end].to_vec();
                        if st.sealed {
                            reader.sealed();
                        }
                        (batch, st.sealed && end == st.events.len())
                    };
                    if let Some(last) = batch.last() {
                        *next = last.last + 1;
                    }
                    if at_end {
                        self.at = if self.follow { Position::Waiting(buffer.next.clone()) } else { Position::Done };
                    }
                    if !batch.is_empty() {
                        return Delivery::Events(batch);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_id_is_a_turn_id_and_an_index() {
        assert_eq!(EventId::parse("t:x:2"), Some(EventId { turn_id: "t:x".into(), index: 2 }));
        for bad in ["", "t", "t:", ":1", "t:-1", "t:1.5", "t:99999999999"] {
            assert_eq!(EventId::parse(bad), None, "{bad}");
        }
    }
}
