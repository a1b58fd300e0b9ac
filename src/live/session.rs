//! One WebSocket session, as its connection's loop (`net::websocket`) drives it: the messages it
//! has to write, already encoded as frames, the conversations it follows, and the ops its client
//! sends, which the routes define ([`Ops`]).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::future::BoxFuture;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::subscriptions::Subscriptions;
use crate::encoding::{WS_PING, WS_PONG, WS_TEXT, put_ws_frame};
use crate::hub::Hub;
use crate::metrics::{Metrics, StreamPermit};
use crate::status::StatusChange;
use crate::store::Store;

/// What a session's client may ask: the routes' half of the protocol.
pub trait Ops: Send + Sync {
    /// Handles one op (a text message); replies go to the session.
    fn handle<'a>(&'a self, session: &'a mut Session, op: &'a str) -> BoxFuture<'a, ()>;
}

/// What a route sets a session up with.
pub struct SessionSetup {
    pub ops: Arc<dyn Ops>,
    pub hub: Arc<Hub>,
    /// Most conversations the session may follow at once.
    pub max_subscriptions: usize,
    pub store: Store,
    pub metrics: Arc<Metrics>,
    /// Every conversation's status changes.
    pub statuses: broadcast::Receiver<StatusChange>,
    /// The period of pings to the client.
    pub keepalive: Option<Duration>,
    /// Cancelled at shutdown once the turns have drained: deliver what is available, then
    /// close with 1001.
    pub drained: CancellationToken,
    /// Largest message (fragments joined) the client may send.
    pub max_message: usize,
    /// How long a frame, or a fragmented message, may take to arrive whole.
    pub message_timeout: Duration,
    /// The gateway's room for messages being assembled (`--max-reading-bytes`).
    pub reading: super::ReadingBudget,
    /// Holds the session's place under the stream cap.
    pub permit: StreamPermit,
    /// The user whose conversations alone the session hears of (`None`: an administrator).
    pub viewer: Option<Arc<str>>,
}

pub struct Session {
    ops: Arc<dyn Ops>,
    hub: Arc<Hub>,
    store: Store,
    pub metrics: Arc<Metrics>,
    /// Frames to write, in order.
    out: BytesMut,
    subscriptions: Subscriptions,
    statuses: Option<broadcast::Receiver<StatusChange>>,
    pub keepalive: Option<Duration>,
    pub drained: CancellationToken,
    pub max_message: usize,
    pub message_timeout: Duration,
    /// The gateway's room for messages being assembled (`--max-reading-bytes`).
    pub reading: super::ReadingBudget,
    _permit: StreamPermit,
    viewer: Option<Arc<str>>,
}

impl Session {
    /// A session that opens with the `catalog` message.
    pub fn new(setup: SessionSetup) -> Session {
        let mut session = Session {
            ops: setup.ops,
            subscriptions: Subscriptions::new(setup.hub.clone(), setup.max_subscriptions),
            hub: setup.hub,
            store: setup.store,
            metrics: setup.metrics,
            out: BytesMut::new(),
            statuses: Some(setup.statuses),
            keepalive: setup.keepalive,
            drained: setup.drained,
            max_message: setup.max_message,
            message_timeout: setup.message_timeout,
            reading: setup.reading,
            _permit: setup.permit,
            viewer: setup.viewer,
        };
        session.send(&json!({"type": "catalog", "catalog": []}));
        session
    }

    /// Handles one op from the client.
    pub async fn handle(&mut self, op: &str) {
        let ops = self.ops.clone();
        ops.handle(self, op).await;
    }

    /// Queues a JSON message.
    pub fn send(&mut self, message: &Value) {
        put_ws_frame(&mut self.out, WS_TEXT, message.to_string().as_bytes());
    }

    pub fn ping(&mut self) {
        put_ws_frame(&mut self.out, WS_PING, &[]);
    }

    pub fn pong(&mut self, payload: &[u8]) {
        put_ws_frame(&mut self.out, WS_PONG, payload);
    }

    /// Queues `conversation.statusChanged`, encoded by the first session that writes the
    /// change and shared by every other.
    pub fn status_changed(&mut self, change: &StatusChange) {
        if !change.visible_to(self.viewer.as_deref()) {
            return;
        }
        let text = change.encoded(|conversation_id, status| {
            let message =
                json!({"type": "conversation.statusChanged", "conversationId": conversation_id, "status": status});
            bytes::Bytes::from(message.to_string())
        });
        put_ws_frame(&mut self.out, WS_TEXT, &text);
    }

    /// Queues the `chat.resync` for a subscription whose position in `turn_id` was coalesced
    /// away: the client refetches history up to the turn, and the turn's replay follows from its
    /// start. False when the
    /// log cannot be read: the session must end (the client comes back and resubscribes), never
    /// point the client at a made-up position.
    pub async fn resync(&mut self, conversation_id: &str, turn_id: &str) -> bool {
        self.metrics.lag_recoveries.fetch_add(1, Relaxed);
        match self.store.latest_seq(conversation_id, Some(turn_id)).await {
            Ok(latest_seq) => {
                self.send(&json!({"type": "chat.resync", "conversationId": conversation_id, "latestSeq": latest_seq}));
                true
            }
            Err(e) => {
                tracing::error!(conversation_id, error = %e, "cannot read the log for a resync; closing the session");
                false
            }
        }
    }

    /// The frames queued so far.
    pub fn out(&mut self) -> &mut BytesMut {
        &mut self.out
    }

    pub fn subscriptions(&mut self) -> &mut Subscriptions {
        &mut self.subscriptions
    }

    /// Every conversation's status changes, for the loop to wait on (once: `None` after).
    pub fn take_statuses(&mut self) -> Option<broadcast::Receiver<StatusChange>> {
        self.statuses.take()
    }

    /// The hub's flush window now (status changes are held for as long).
    /// Why the session was ended early: its credential was taken back (none: it was not).
    pub fn ended(&self) -> Option<&str> {
        self._permit.ended()
    }

    pub fn window(&self) -> Duration {
        self.hub.window()
    }
}
