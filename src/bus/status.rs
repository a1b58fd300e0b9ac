//! Status changes (`conversation.statusChanged`) between gateways, over plain NATS: a change
//! is news only while it happens, so it is not kept in the stream.

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use super::Bus;
use super::sign::{Signer, reject};
use crate::wire::ConversationStatus;

const SUBJECT: &str = "dispatch.status";

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Change {
    node: String,
    conversation_id: String,
    status: ConversationStatus,
}

impl Bus {
    /// Tells the other gateways of a change made here (sent in order, without waiting; held
    /// while the bus is down and sent once it is back).
    pub(super) fn announce(&self, conversation_id: &str, status: ConversationStatus) {
        let change = Change { node: self.0.node.clone(), conversation_id: conversation_id.to_owned(), status };
        let payload = serde_json::to_vec(&change).expect("a status change serializes");
        let _ = self.0.statuses.send((conversation_id.to_owned(), payload.into()));
    }
}

/// Changes held while the bus is down: the last one of each conversation (an older one is no
/// news once a newer one is known), at most this many bytes of them (the oldest goes first).
const MOST_HELD_BYTES: usize = 8 * 1024 * 1024;

/// Sends the changes announced here, one after the other (the client queues them in order),
/// each signed and stamped with when it was sent. While the bus is down they are held (the
/// client would take them and lose them at the next reconnection), and sent, oldest first,
/// once it is back: a session elsewhere learns that a turn ended during an outage.
pub(super) async fn send_statuses(
    client: async_nats::Client,
    signer: std::sync::Arc<Signer>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<(String, bytes::Bytes)>,
) {
    let connected = || super::connected(&client);
    // Held changes by conversation, with the order they came in, and their bytes.
    let mut held: std::collections::HashMap<String, (u64, bytes::Bytes)> = std::collections::HashMap::new();
    let (mut order, mut held_bytes) = (0u64, 0usize);
    loop {
        let next = if held.is_empty() {
            changes.recv().await
        } else {
            // Held changes wait for the bus; new ones join them meanwhile.
            tokio::select! {
                change = changes.recv() => change,
                _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {
                    if connected() {
                        held_bytes = 0;
                        let mut waiting: Vec<(u64, bytes::Bytes)> = held.drain().map(|(_, v)| v).collect();
                        waiting.sort_by_key(|(at, _)| *at);
                        for (_, payload) in waiting {
                            publish(&client, &signer, payload).await;
                        }
                    }
                    continue;
                }
            }
        };
        let Some((conversation_id, payload)) = next else { return };
        if held.is_empty() && connected() {
            publish(&client, &signer, payload).await;
            continue;
        }
        order += 1;
        held_bytes += conversation_id.len() + payload.len();
        if let Some((_, older)) = held.insert(conversation_id.clone(), (order, payload)) {
            held_bytes -= conversation_id.len() + older.len();
        }
        while held_bytes > MOST_HELD_BYTES
            && let Some(oldest) = held.iter().min_by_key(|(_, (at, _))| *at).map(|(id, _)| id.clone())
        {
            if let Some((_, dropped)) = held.remove(&oldest) {
                held_bytes -= oldest.len() + dropped.len();
            }
        }
    }
}

async fn publish(client: &async_nats::Client, signer: &Signer, payload: bytes::Bytes) {
    let mut headers = async_nats::HeaderMap::new();
    signer.sign_fresh(SUBJECT, &mut headers, &payload);
    if let Err(e) = client.publish_with_headers(SUBJECT, headers, payload).await {
        tracing::warn!(error = %e, "could not send a status change to the bus");
    }
}

/// Hands every change the other gateways announce to `deliver`, until it returns false.
pub(super) async fn relay_statuses(bus: Bus, deliver: impl Fn(&str, ConversationStatus) -> bool) {
    let Some(mut subscriber) = bus.listen(SUBJECT, "status changes").await else { return };
    while let Some(message) = subscriber.next().await {
        if !bus.0.signer.verify_fresh(&message.subject, message.headers.as_ref(), &message.payload) {
            reject(&bus.0.metrics, "a status change", &message.subject);
            continue;
        }
        let Ok(change) = serde_json::from_slice::<Change>(&message.payload) else {
            tracing::warn!("skipped a status change that does not parse");
            continue;
        };
        if change.node != bus.0.node && !deliver(&change.conversation_id, change.status) {
            return;
        }
    }
}
