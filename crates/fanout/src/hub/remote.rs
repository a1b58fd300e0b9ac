//! Where a hub meets the hubs of other gateways (the bus, `src/bus/`; none on a single node).
//!
//! Two ways through it: every event of a turn this gateway runs goes out through the turn's
//! [`Outbox`], and a conversation watched here is [`Following`]: the turns other gateways run
//! in it are fed into this hub as if they ran here, with the same event indices, so watchers
//! read them from one local buffer like any other.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};

use super::Hub;

pub trait Remote: Send + Sync {
    /// The outbox of a turn this gateway runs, which holds at most `cap` bytes waiting.
    fn outbox(&self, conversation_id: &str, turn_id: &str, cap: usize) -> Outbox;

    /// Starts feeding `hub` the turns other gateways run in the conversation, until the
    /// handle is dropped.
    fn follow(&self, hub: Weak<Hub>, conversation_id: Arc<str>) -> Following;

    /// Keeps `hub` told how many watchers the other gateways have (`Hub::set_readers_elsewhere`)
    /// and them told of its own, until the hub is gone.
    fn share_readers(&self, hub: Weak<Hub>);

    /// How long a new watcher waits for a conversation to be caught up before it reads what
    /// the hub has.
    fn catch_up_timeout(&self) -> Duration;
}

/// One event on its way out.
pub struct Outgoing {
    /// Its index in the turn.
    pub index: u32,
    /// Its NDJSON line.
    pub line: Bytes,
    /// Whether it is the turn's last (`turn-sealed`).
    pub last: bool,
}

/// The sending end of a turn's way to the bus. Sending never waits: past the cap the turn's
/// events stop going out (the bus's readers see the gap and end the turn), except the last,
/// which always does.
///
/// Events wait here for the turn's next round ([`Outbox::release`]), and go to the publisher
/// together: under a flush window the bus carries what a round carries, in one message, as a
/// watcher's write does. A message per event cost the bus (nats-server's work per message)
/// as much again as the deliveries of the gateways following the turn (BENCHMARKS.md, W2
/// spread over three); the followers' watchers wait no longer for it, as their own rounds
/// would have gathered the same events.
pub struct Outbox {
    sender: mpsc::UnboundedSender<Vec<Outgoing>>,
    /// Events since the last round.
    held: Mutex<Vec<Outgoing>>,
    /// Bytes sent and not yet taken by the publisher.
    pending: Arc<AtomicUsize>,
    cap: usize,
    overflowed: AtomicBool,
    closed: AtomicBool,
}

impl Outbox {
    /// An outbox and the receiving end its publisher reads (taking bytes off `pending` as it
    /// goes).
    pub fn new(cap: usize) -> (Outbox, mpsc::UnboundedReceiver<Vec<Outgoing>>, Arc<AtomicUsize>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let pending = Arc::new(AtomicUsize::new(0));
        let outbox = Outbox {
            sender,
            held: Mutex::default(),
            pending: pending.clone(),
            cap,
            overflowed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        };
        (outbox, receiver, pending)
    }

    pub(super) fn send(&self, index: u32, line: &Bytes, last: bool) {
        if self.closed.load(Relaxed) {
            return;
        }
        let over = self.pending.load(Relaxed) + line.len() > self.cap;
        if !last && (over || self.overflowed.load(Relaxed)) {
            if !self.overflowed.swap(true, Relaxed) {
                tracing::warn!(index, "the bus is not keeping up with a turn: its further events stay on this gateway");
            }
            return;
        }
        self.pending.fetch_add(line.len(), Relaxed);
        self.lock().push(Outgoing { index, line: line.clone(), last });
    }

    /// A round runs: what it carries goes to the publisher.
    pub(super) fn release(&self) {
        // Sent under the lock: two rounds racing hand their events over in order.
        let mut held = self.lock();
        if !held.is_empty() {
            let _ = self.sender.send(std::mem::take(&mut *held));
        }
    }

    /// Nothing more of the turn goes out (it lost its lease: what it says now is not the
    /// cluster's account of the turn).
    pub(super) fn close(&self) {
        self.closed.store(true, Relaxed);
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Outgoing>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A conversation followed from the bus; dropping it stops the following.
pub struct Following {
    caught_up: watch::Receiver<bool>,
    task: tokio::task::AbortHandle,
}

impl Following {
    /// `caught_up` turns true once the turn in flight elsewhere (if any) is in the hub.
    pub fn new(caught_up: watch::Receiver<bool>, task: tokio::task::AbortHandle) -> Following {
        Following { caught_up, task }
    }

    /// Waits until the conversation is caught up, at most `within`.
    pub(super) async fn caught_up(&self, within: Duration) {
        let mut caught_up = self.caught_up.clone();
        if tokio::time::timeout(within, caught_up.wait_for(|done| *done)).await.is_err() {
            tracing::warn!("the bus did not catch a conversation up in time: serving what this gateway has");
        }
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        self.task.abort();
    }
}
