//! The conversations one WebSocket session follows, each a hub cursor.
//!
//! A session may follow up to a configured number of conversations, and what it costs must not
//! grow with that number: subscribing is a map insert, and a published event wakes only the
//! cursors of its own conversation. Cursors with nothing to read wait in a
//! [`FuturesUnordered`], which polls only the futures whose cursor was woken; cursors with
//! something to read (or just subscribed) are *at hand*, where the session's loop takes their
//! batches. Unsubscribing is a map removal: an entry at hand that is no longer in the map is
//! dropped when reached, and a waiting one is told to give its cursor back.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::oneshot;

use crate::hub::{BATCH, Cursor, Delivery, Hub, TurnBuffer};

/// A waiting cursor's future: its conversation and generation, the cursor, and what it got
/// (`None`: it was told to give the cursor back).
type Waiting = Pin<Box<dyn Future<Output = (Arc<str>, u64, Cursor, Option<Delivery>)> + Send>>;

struct Entry {
    generation: u64,
    /// Set while the cursor waits; sending on it (or dropping it) gives the cursor back.
    give_back: Option<oneshot::Sender<()>>,
}

pub struct Subscriptions {
    hub: Arc<Hub>,
    cap: usize,
    /// Every subscription by conversation.
    entries: HashMap<Arc<str>, Entry>,
    /// Cursors the session reads next, with their conversation and generation.
    at_hand: Vec<(Arc<str>, u64, Cursor)>,
    waiting: FuturesUnordered<Waiting>,
    generations: u64,
}

impl Subscriptions {
    pub fn new(hub: Arc<Hub>, cap: usize) -> Subscriptions {
        Subscriptions {
            hub,
            cap,
            entries: HashMap::new(),
            at_hand: Vec::new(),
            waiting: FuturesUnordered::new(),
            generations: 0,
        }
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Follows a conversation from its in-flight turn's first event (idempotent); false when
    /// the cap is reached.
    pub async fn add(&mut self, conversation_id: &str) -> bool {
        if self.entries.contains_key(conversation_id) {
            return true;
        }
        if self.entries.len() >= self.cap {
            return false;
        }
        let id: Arc<str> = Arc::from(conversation_id);
        let (cursor, _) = self.hub.subscribe(conversation_id, None).await;
        self.generations += 1;
        self.entries.insert(id.clone(), Entry { generation: self.generations, give_back: None });
        self.at_hand.push((id, self.generations, cursor));
        true
    }

    pub fn remove(&mut self, conversation_id: &str) {
        if let Some(entry) = self.entries.remove(conversation_id)
            && let Some(give_back) = entry.give_back
        {
            let _ = give_back.send(());
        }
    }

    fn current(&self, id: &str, generation: u64) -> bool {
        self.entries.get(id).is_some_and(|e| e.generation == generation)
    }

    /// The next batch of any subscription, without waiting: cursors with nothing to read go
    /// to wait, but with `keep_single` the session's only subscription stays at hand (the
    /// session parks it).
    pub fn try_next(&mut self, keep_single: bool) -> Option<(Arc<str>, Delivery)> {
        use futures_util::FutureExt;
        loop {
            // Cursors whose wait ended come back to hand first.
            while let Some((id, generation, cursor, got)) = self.waiting.next().now_or_never().flatten() {
                if let Some(delivery) = self.back(id, generation, cursor, got) {
                    return Some(delivery);
                }
            }
            let (id, generation, mut cursor) = self.at_hand.pop()?;
            if !self.current(&id, generation) {
                continue;
            }
            if let Some(delivery) = cursor.try_batch(BATCH) {
                return self.back(id, generation, cursor, Some(delivery));
            }
            if keep_single && self.entries.len() == 1 {
                self.at_hand.push((id, generation, cursor));
                return None;
            }
            self.wait(id, generation, cursor);
        }
    }

    /// Waits for the next batch of any waiting subscription (never, with none waiting).
    pub async fn next(&mut self) -> (Arc<str>, Delivery) {
        loop {
            let Some((id, generation, cursor, got)) = self.waiting.next().await else {
                return std::future::pending().await;
            };
            if let Some(delivery) = self.back(id, generation, cursor, got) {
                return delivery;
            }
        }
    }

    /// A cursor back from waiting or reading: at hand again with what it got, unless it was
    /// unsubscribed meanwhile or has ended.
    fn back(
        &mut self,
        id: Arc<str>,
        generation: u64,
        cursor: Cursor,
        got: Option<Delivery>,
    ) -> Option<(Arc<str>, Delivery)> {
        if !self.current(&id, generation) {
            return None;
        }
        let delivery = got?;
        if matches!(delivery, Delivery::End) {
            self.entries.remove(&id);
        } else {
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.give_back = None;
            }
            self.at_hand.push((id.clone(), generation, cursor));
        }
        Some((id, delivery))
    }

    fn wait(&mut self, id: Arc<str>, generation: u64, mut cursor: Cursor) {
        let (give_back, given_back) = oneshot::channel();
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.give_back = Some(give_back);
        }
        self.waiting.push(Box::pin(async move {
            let got = tokio::select! {
                biased;
                _ = given_back => None,
                delivery = cursor.next_batch(BATCH) => Some(delivery),
            };
            (id, generation, cursor, got)
        }));
    }

    /// The only subscription, when it is at hand and its turn is paced: the session may park
    /// it (the turn's rounds then write its frames).
    pub fn parkable(&mut self) -> Option<(Arc<TurnBuffer>, u32)> {
        if self.entries.len() != 1 {
            return None;
        }
        let (id, generation, _) = self.at_hand.last()?;
        if !self.current(id, *generation) {
            return None;
        }
        let (_, _, cursor) = self.at_hand.last()?;
        let (buffer, next) = cursor.position().filter(|(buffer, _)| buffer.paced())?;
        Some((buffer.clone(), next))
    }

    /// The cursor of the only subscription at hand (the one [`Self::parkable`] gave).
    pub fn single(&mut self) -> Option<&mut Cursor> {
        self.at_hand.last_mut().map(|(_, _, cursor)| cursor)
    }

    /// Drops every subscription (shutdown, once what was ready has gone out).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.at_hand.clear();
        self.waiting = FuturesUnordered::new();
    }
}
