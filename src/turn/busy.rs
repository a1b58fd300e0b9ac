//! What each conversation is busy with on this gateway, one thing at a time: a turn starting,
//! running or sealing, or a deletion. The rules every start, stop, queue, deletion and lease
//! renewal goes through live here, with their tests:
//!
//! - **One at a time**: a conversation busy with anything refuses another reservation (`409`),
//!   one being deleted says so (it is gone for reads already).
//! - **A cap**: at most `--max-turns` conversations busy at once; a new turn past it is `503`.
//! - **Sealing holds**: a turn that ended keeps its conversation until its seal commits, so a
//!   next turn never starts before the last one is history; one whose messages were queued too
//!   late hands the conversation straight to their turn, never idle in between.
//! - **Leases**: the turn ids (and deletion holders) this gateway holds leases for, and a way
//!   to end the running turns whose lease is found gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

use super::{Control, ControlReply, StartError};
use crate::runtime::{Inbox, QueueFull, QueueLimits, QueuedMessage};
use crate::store::StoreError;

/// What a conversation is busy with.
pub(super) enum Busy {
    /// Reserved while the turn's first rows are written.
    Starting,
    Running {
        turn_id: String,
        cancel: CancellationToken,
        /// Fired when the lease renewal finds the turn's lease gone (another gateway marked it
        /// interrupted while this one was paused): the turn ends at once with `error{lease}`.
        lease_lost: CancellationToken,
        inbox: Arc<Inbox>,
    },
    /// Reserved while the conversation is deleted, under the lease of `holder`.
    Deleting { holder: String },
    /// The turn ended but the database has not taken its seal yet.
    Sealing { turn_id: String },
}

/// The conversations busy on this gateway.
pub(super) struct Reservations {
    busy: Mutex<HashMap<String, Busy>>,
    /// Conversations busy at once, at most (`--max-turns`).
    max: usize,
}

/// Frees a reservation when dropped, unless it was turned into a running turn ([`Reserved::keep`]).
pub(super) struct Reserved<'a> {
    reservations: &'a Reservations,
    conversation_id: &'a str,
    armed: bool,
}

impl Reserved<'_> {
    /// The reservation outlives this guard (the turn runs, and releases it when it ends).
    pub(super) fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.reservations.release(self.conversation_id);
        }
    }
}

impl Reservations {
    pub(super) fn new(max: usize) -> Reservations {
        Reservations { busy: Mutex::default(), max }
    }

    /// Reserves the conversation for `what`, unless it is busy, being deleted, or (for a turn)
    /// the cap is reached.
    pub(super) fn reserve<'a>(&'a self, conversation_id: &'a str, what: Busy) -> Result<Reserved<'a>, StartError> {
        let mut busy = self.lock();
        match busy.get(conversation_id) {
            Some(Busy::Deleting { .. }) => return Err(StartError::Store(StoreError::Deleting)),
            Some(_) => return Err(StartError::Busy),
            None => {}
        }
        // Counted over the whole map, deletions too: a count of turns alone would have to
        // follow every change of state.
        if matches!(what, Busy::Starting) && busy.len() >= self.max {
            return Err(StartError::Full(self.max));
        }
        busy.insert(conversation_id.to_owned(), what);
        Ok(Reserved { reservations: self, conversation_id, armed: true })
    }

    /// The guard of a reservation a turn handed over ([`Reservations::hand_over`]): dropped
    /// before its turn runs, it frees the conversation.
    pub(super) fn adopt<'a>(&'a self, conversation_id: &'a str) -> Reserved<'a> {
        Reserved { reservations: self, conversation_id, armed: true }
    }

    /// The reserved conversation's turn runs (its ids, cancellation and inbox in `running`).
    pub(super) fn run(&self, conversation_id: &str, running: Busy) {
        self.lock().insert(conversation_id.to_owned(), running);
    }

    /// Frees the conversation: a turn calls it right before it publishes `turn-sealed`.
    pub(super) fn release(&self, conversation_id: &str) {
        self.lock().remove(conversation_id);
    }

    /// Keeps the conversation reserved after its turn ended, for the turn of the messages
    /// queued too late for it.
    pub(super) fn hand_over(&self, conversation_id: &str) {
        self.lock().insert(conversation_id.to_owned(), Busy::Starting);
    }

    /// Keeps the conversation reserved after its turn ended, until the seal commits.
    pub(super) fn hold_for_sealing(&self, conversation_id: &str, turn_id: &str) {
        self.lock().insert(conversation_id.to_owned(), Busy::Sealing { turn_id: turn_id.to_owned() });
    }

    /// Whether a turn is starting, running or sealing in the conversation.
    pub(super) fn is_active(&self, conversation_id: &str) -> bool {
        matches!(self.lock().get(conversation_id), Some(Busy::Starting | Busy::Running { .. } | Busy::Sealing { .. }))
    }

    /// Whether the conversation is busy here with anything (its lease is this gateway's).
    pub(super) fn holds(&self, conversation_id: &str) -> bool {
        self.lock().contains_key(conversation_id)
    }

    /// Asks the conversation's running turn to stop; whether one runs here.
    pub(super) fn stop(&self, conversation_id: &str) -> bool {
        match self.lock().get(conversation_id) {
            Some(Busy::Running { cancel, .. }) => {
                cancel.cancel();
                true
            }
            _ => false,
        }
    }

    /// Queues `message` for the conversation's running turn; `None` when none runs here.
    pub(super) fn queue(
        &self,
        conversation_id: &str,
        message: QueuedMessage,
        limits: QueueLimits,
    ) -> Option<Result<Vec<QueuedMessage>, QueueFull>> {
        match self.lock().get(conversation_id)? {
            Busy::Running { inbox, .. } => Some(inbox.push(message, limits)),
            _ => None,
        }
    }

    /// A control request from another gateway, answered when the conversation is busy here.
    pub(super) fn answer(&self, request: Control, limits: QueueLimits) -> Option<ControlReply> {
        match request {
            Control::Stop { conversation_id } => match self.lock().get(&conversation_id)? {
                Busy::Running { cancel, .. } => {
                    cancel.cancel();
                    Some(ControlReply::Stopped(true))
                }
                Busy::Sealing { .. } => Some(ControlReply::Stopped(false)),
                Busy::Starting | Busy::Deleting { .. } => None,
            },
            Control::Queue { conversation_id, message } => {
                self.queue(&conversation_id, message, limits).map(ControlReply::Queued)
            }
        }
    }

    /// Asks every running turn to stop.
    pub(super) fn stop_all(&self) {
        for busy in self.lock().values() {
            if let Busy::Running { cancel, .. } = busy {
                cancel.cancel();
            }
        }
    }

    /// Turns running now.
    pub(super) fn running(&self) -> usize {
        self.lock().values().filter(|s| matches!(s, Busy::Running { .. })).count()
    }

    /// The leases this gateway holds: of turns running or sealing, and of deletions.
    pub(super) fn leased(&self) -> Vec<String> {
        self.lock()
            .values()
            .filter_map(|b| match b {
                Busy::Running { turn_id, .. } | Busy::Sealing { turn_id } => Some(turn_id.clone()),
                Busy::Deleting { holder } => Some(holder.clone()),
                Busy::Starting => None,
            })
            .collect()
    }

    /// Ends the running turns among `turn_ids` with `error{lease}`: their leases are gone.
    pub(super) fn lost_leases<'a>(&self, turn_ids: impl Iterator<Item = &'a String>) {
        let busy = self.lock();
        for lost in turn_ids {
            for b in busy.values() {
                if let Busy::Running { turn_id, lease_lost, .. } = b
                    && turn_id == lost
                {
                    tracing::error!(turn = %turn_id, "a running turn's lease is gone (another gateway marked it interrupted); ending it");
                    lease_lost.cancel();
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Busy>> {
        self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: QueueLimits = QueueLimits { messages: 4, bytes: 1024 };

    fn running(turn_id: &str) -> (Busy, CancellationToken, CancellationToken) {
        let (cancel, lease_lost) = (CancellationToken::new(), CancellationToken::new());
        let busy = Busy::Running {
            turn_id: turn_id.to_owned(),
            cancel: cancel.clone(),
            lease_lost: lease_lost.clone(),
            inbox: Arc::default(),
        };
        (busy, cancel, lease_lost)
    }

    fn message(text: &str) -> QueuedMessage {
        QueuedMessage { id: text.to_owned(), text: text.to_owned(), queued_at: 0 }
    }

    #[test]
    fn a_conversation_is_busy_with_one_thing_at_a_time() {
        let r = Reservations::new(10);
        let first = r.reserve("c", Busy::Starting).unwrap();
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Busy)));
        assert!(matches!(r.reserve("c", Busy::Deleting { holder: "h".into() }), Err(StartError::Busy)));
        assert!(r.reserve("other", Busy::Starting).is_ok(), "another conversation is free");
        drop(first);
        assert!(!r.holds("c"), "a reservation dropped before its turn ran frees the conversation");
        let deleting = r.reserve("c", Busy::Deleting { holder: "h".into() }).unwrap();
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Store(StoreError::Deleting))));
        assert!(!r.is_active("c"), "a deletion is no turn");
        drop(deleting);
    }

    #[test]
    fn past_the_cap_a_new_turn_is_refused_and_a_freed_place_is_taken_again() {
        let r = Reservations::new(2);
        let a = r.reserve("a", Busy::Starting).unwrap();
        let _b = r.reserve("b", Busy::Starting).unwrap();
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Full(2))));
        drop(a);
        assert!(r.reserve("c", Busy::Starting).is_ok());
    }

    #[test]
    fn a_running_turn_keeps_its_conversation_until_it_releases_it_and_sealing_holds_it_too() {
        let r = Reservations::new(10);
        let (turn, cancel, _) = running("t1");
        r.reserve("c", Busy::Starting).unwrap().keep();
        r.run("c", turn);
        assert!(r.is_active("c") && r.running() == 1);
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Busy)));
        // The turn ended; its seal has not committed yet.
        r.hold_for_sealing("c", "t1");
        assert!(r.is_active("c") && r.running() == 0);
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Busy)), "no next turn before the seal");
        assert!(!r.stop("c"), "nothing runs to stop");
        assert!(!cancel.is_cancelled());
        let reply = r.answer(Control::Stop { conversation_id: "c".into() }, LIMITS);
        assert!(matches!(reply, Some(ControlReply::Stopped(false))), "{reply:?}");
        // Messages queued too late: their turn takes the conversation, never free between.
        r.hand_over("c");
        assert!(r.is_active("c"));
        assert!(matches!(r.reserve("c", Busy::Starting), Err(StartError::Busy)));
        r.release("c");
        assert!(!r.holds("c"));
        assert!(r.reserve("c", Busy::Starting).is_ok());
    }

    #[test]
    fn a_stop_or_a_message_reaches_the_running_turn_only() {
        let r = Reservations::new(10);
        assert!(!r.stop("c"));
        assert!(r.queue("c", message("m"), LIMITS).is_none());
        let (turn, cancel, _) = running("t1");
        r.run("c", turn);
        assert_eq!(r.queue("c", message("m"), LIMITS).unwrap().unwrap().len(), 1);
        let reply = r.answer(Control::Queue { conversation_id: "c".into(), message: message("n") }, LIMITS);
        assert!(matches!(reply, Some(ControlReply::Queued(Ok(ref queue))) if queue.len() == 2), "{reply:?}");
        assert!(r.stop("c"));
        assert!(cancel.is_cancelled());
    }

    #[test]
    fn the_leases_held_are_those_of_running_and_sealing_turns_and_deletions_and_a_lost_one_ends_its_turn() {
        let r = Reservations::new(10);
        let (one, _, one_lost) = running("t1");
        let (two, _, two_lost) = running("t2");
        r.run("a", one);
        r.run("b", two);
        r.hold_for_sealing("c", "t3");
        r.reserve("d", Busy::Deleting { holder: "h".into() }).unwrap().keep();
        r.reserve("e", Busy::Starting).unwrap().keep();
        let mut leased = r.leased();
        leased.sort();
        assert_eq!(leased, ["h", "t1", "t2", "t3"], "a turn still starting holds no lease yet");
        r.lost_leases(["t2".to_owned()].iter());
        assert!(two_lost.is_cancelled(), "the turn whose lease is gone is told");
        assert!(!one_lost.is_cancelled(), "the others run on");
        r.stop_all();
        assert_eq!(r.running(), 2, "stopping asks; the turns release their conversations themselves");
    }
}
