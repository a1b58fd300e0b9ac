//! Status changes (`conversation.statusChanged`): a conversation went active, idle or closed.
//! The turns tell them (and the bus, another gateway's); every WebSocket session hears them,
//! a user's session only those of the user's own conversations.

use std::sync::Arc;

use tokio::sync::{broadcast, mpsc};

use crate::store::Store;
use crate::wire::ConversationStatus;

/// Status changes kept for the WebSocket sessions (and waiting for their owner's lookup).
const STATUS_CHANGES: usize = 1024;

/// A conversation went active, idle or closed. Every WebSocket session gets it; the first to
/// write it encodes it for all of them (a clone shares the encoding).
#[derive(Debug, Clone)]
pub struct StatusChange(Arc<Change>);

#[derive(Debug)]
struct Change {
    conversation_id: String,
    status: ConversationStatus,
    /// The conversation's owner, when users may be watching (else not looked up: everyone
    /// watching is an administrator).
    owner: Option<String>,
    encoded: std::sync::OnceLock<bytes::Bytes>,
}

impl StatusChange {
    fn new(conversation_id: &str, status: ConversationStatus, owner: Option<String>) -> StatusChange {
        StatusChange(Arc::new(Change {
            conversation_id: conversation_id.to_owned(),
            status,
            owner,
            encoded: std::sync::OnceLock::new(),
        }))
    }

    /// Whether a session of `viewer` (`None`: an administrator) hears of this change: a user
    /// hears only of their own conversations.
    pub fn visible_to(&self, viewer: Option<&str>) -> bool {
        viewer.is_none() || self.0.owner.as_deref() == viewer
    }

    /// The change as a transport encodes it: `encode` runs once for all the clones.
    pub fn encoded(&self, encode: impl FnOnce(&str, ConversationStatus) -> bytes::Bytes) -> bytes::Bytes {
        self.0.encoded.get_or_init(|| encode(&self.0.conversation_id, self.0.status)).clone()
    }
}

/// Where status changes go: to every session, through an owner lookup when users may watch.
pub struct Statuses {
    sessions: broadcast::Sender<StatusChange>,
    /// With users about (signed tokens taken), changes go through here to have their
    /// conversation's owner looked up, in order, before sessions hear of them.
    owners: Option<mpsc::Sender<(String, ConversationStatus)>>,
}

impl Statuses {
    /// Status changes to sessions; with `users`, each change's owner looked up in `store`.
    pub fn new(store: Store, users: bool) -> Statuses {
        let (sessions, _) = broadcast::channel(STATUS_CHANGES);
        let owners = users.then(|| {
            // As many as the sessions' own channel keeps (ids of at most 128 bytes: ~200 KiB);
            // past it, while the database is slow, changes are dropped as a lagging session's
            // are (a status change is news only while it happens).
            let (tx, rx) = mpsc::channel(STATUS_CHANGES);
            tokio::spawn(resolve_owners(store, sessions.clone(), rx));
            tx
        });
        Statuses { sessions, owners }
    }

    /// Every status change from now on (a receiver that lags loses the oldest).
    pub fn subscribe(&self) -> broadcast::Receiver<StatusChange> {
        self.sessions.subscribe()
    }

    /// Hands a change to the sessions (through the owner lookup, with users about).
    pub fn tell(&self, conversation_id: &str, status: ConversationStatus) {
        match &self.owners {
            Some(owners) => {
                if owners.try_send((conversation_id.to_owned(), status)).is_err() {
                    tracing::debug!(conversation_id, "a status change was dropped: its owner lookups are behind");
                }
            }
            None => {
                let _ = self.sessions.send(StatusChange::new(conversation_id, status, None));
            }
        }
    }
}

/// Looks up the owner of each changed conversation, in order, and hands the change to the
/// sessions (a user's session hears only of their own conversations). A change whose lookup
/// fails goes to administrators only.
async fn resolve_owners(
    store: Store,
    statuses: broadcast::Sender<StatusChange>,
    mut changes: mpsc::Receiver<(String, ConversationStatus)>,
) {
    while let Some((conversation_id, status)) = changes.recv().await {
        let owner = match store.ownership(&conversation_id).await {
            Ok(crate::store::Ownership::Owned(owner)) => owner,
            _ => None,
        };
        let _ = statuses.send(StatusChange::new(&conversation_id, status, owner));
    }
}
